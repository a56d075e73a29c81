"""What a result was measured on: the machine, torch, the workers' devices, an emulated cluster.

``collect_setup()`` is recorded in ``compare.json`` (``settings.setup``) when a comparison
starts; ``setup_lines`` prints it, the devices each worker joined with (from the runs'
``join`` events) and, when given, the emulated cluster as a dict of plain data (nodes, CPU
budgets, links), each key on its own line.
"""

from __future__ import annotations

import json
import os
import platform
import re
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.training.tables import natural_key


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


def worker_devices(run_dirs: Sequence[str | Path]) -> dict[str, str]:
    """Each worker's device, from the ``join`` events of the runs' ``metrics.jsonl``.

    Args:
        run_dirs: run directories (missing files are skipped).

    Returns:
        worker name -> device, sorted by name (``w2`` before ``w10``).
    """
    found: dict[str, str] = {}
    for run_dir in run_dirs:
        path = Path(run_dir) / "metrics.jsonl"
        if not path.is_file():
            continue
        with path.open(encoding="utf-8") as handle:
            for line in handle:
                if '"join"' not in line:
                    continue
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("event") == "join" and event.get("worker"):
                    found.setdefault(str(event["worker"]), str(event.get("device") or "?"))
    return {name: found[name] for name in sorted(found, key=natural_key)}


def setup_lines(setup: dict[str, Any] | None, devices: dict[str, str]) -> list[str]:
    """Markdown bullet lines of the setup block (the emulated cluster has its own lines, from
    ``launch.report.cluster_lines``).

    Args:
        setup: ``collect_setup()`` as recorded (None: not recorded).
        devices: worker name -> device.

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
        by_device: dict[str, list[str]] = {}
        for name, device in devices.items():
            by_device.setdefault(device, []).append(name)
        lines.append(
            "- workers' devices: "
            + "; ".join(f"{device}: {', '.join(names)}" for device, names in by_device.items())
        )
    return lines
