"""What a result was measured on: the machine, torch, the workers' devices and hosts, an
emulated cluster.

``collect_setup()`` is recorded in ``compare.json`` (``settings.setup``) when a comparison
starts; ``setup_lines`` prints it, the devices each worker joined with and the hosts it joined
from (the runs' ``join`` events) and, when given, the emulated cluster as a dict of plain data
(nodes, CPU budgets, links), each key on its own line.
"""

from __future__ import annotations

import os
import platform
import re
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.training.tables import natural_key
from launch.procs import new_events


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``, else ``platform.processor()``), or "unknown"."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    match = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return match.group(1).strip() if match else platform.processor() or "unknown"


def collect_setup() -> dict[str, Any]:
    """The machine a comparison runs on.

    Returns:
        ``{"host", "cpu", "cpus", "gpus", "torch", "python", "os"}``; ``gpus`` lists CUDA
        device names (empty without CUDA).
    """
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "host": socket.gethostname(),
        "cpu": cpu_model(),
        "cpus": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "gpus": gpus,
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
    }


def worker_values(run_dirs: Sequence[str | Path], key: str, missing: str = "") -> dict[str, str]:
    """What each worker said of itself at join (``device``, ``host``), from the ``join``
    events of the runs' ``metrics.jsonl``.

    Args:
        run_dirs: run directories (missing files are skipped).
        key: the ``join`` event's field.
        missing: the value of a worker that did not say ("": the worker is left out).

    Returns:
        worker name -> value (the first join's), sorted by name (``w2`` before ``w10``).
    """
    found: dict[str, str] = {}
    events = [e for d in run_dirs for e in new_events(Path(d) / "metrics.jsonl", 0)]
    for event in (e for e in events if e.get("event") == "join" and e.get("worker")):
        value = event.get(key)
        if (isinstance(value, str) and value) or missing:
            found.setdefault(str(event["worker"]), str(value or missing))
    return {name: found[name] for name in sorted(found, key=natural_key)}


def setup_lines(
    setup: dict[str, Any] | None, devices: dict[str, str], hosts: dict[str, str] | None = None
) -> list[str]:
    """Markdown bullet lines of the setup block (the emulated cluster has its own lines, from
    ``launch.report.cluster_lines``).

    Args:
        setup: ``collect_setup()`` as recorded (None: not recorded).
        devices: worker name -> device.
        hosts: worker name -> the host it joined from (absent: not known).

    Returns:
        The lines (empty when there is nothing to say).
    """
    lines = []
    if setup:
        gpus = ", ".join(setup.get("gpus") or []) or "none"
        lines += [
            f"- host: `{setup.get('host')}` ({setup.get('os')}); CPU: {setup.get('cpu')}, "
            f"{setup.get('cpus')} logical CPUs usable; GPUs: {gpus}",
            f"- torch {setup.get('torch')}, Python {setup.get('python')}",
        ]
    if devices:
        lines.append("- workers' devices: " + _grouped(devices))
    if hosts:
        lines.append("- workers' hosts: " + _grouped(hosts, "`"))
    return lines


def _grouped(values: dict[str, str], quote: str = "") -> str:
    """``a: w1, w2; b: w3`` from worker name -> value, values in order of first appearance."""
    by_value: dict[str, list[str]] = {}
    for name, value in values.items():
        by_value.setdefault(value, []).append(name)
    return "; ".join(
        f"{quote}{_shown(value)}{quote}: {', '.join(map(_shown, names))}"
        for value, names in by_value.items()
    )


def _shown(text: str) -> str:
    """``text`` as Markdown shows it literally on one line: printable characters only (at most
    64), no backquote or table bar, HTML's ``&<>`` as entities."""
    kept = "".join(c for c in text[:64] if c.isprintable() and c not in "`|")
    return kept.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
