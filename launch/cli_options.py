"""Click options shared by ``pslaunch local``, ``ddp`` and ``compare``, and what they build."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from common.cli_help import config_option
from common.errors import ConfigError, ModelError
from common.training.models import NORMS, with_norm
from launch.cluster.spec import PRESETS, ClusterSpec, parse_cluster
from launch.settings import TrainSettings
from launch.slowdowns import SCHEDULES_HELP, parse_schedules, parse_slowdowns
from pserver.config import OPTIMIZERS, SCHEDULES, STALENESS

# The training options: every ``TrainSettings`` field but those each command declares itself.
OWN_TRAIN_KEYS = frozenset({"target_oa"})
TRAIN_KEYS = tuple(
    f.name for f in dataclasses.fields(TrainSettings) if f.name not in OWN_TRAIN_KEYS
)
_train = functools.partial(config_option, cls=TrainSettings)


Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def _options(*decorators: Decorator) -> Decorator:
    """One decorator that applies ``decorators`` as if stacked in this order."""

    def apply(func: Callable[..., Any]) -> Callable[..., Any]:
        for decorator in reversed(decorators):
            func = decorator(func)
        return func

    return apply


# --dataset, --model, --workers, --slowdowns, --slowdown-schedules, --devices.
cluster_options = _options(
    click.option(
        "--dataset",
        required=True,
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        help="HDF5 dataset made by 'pserver data'.",
    ),
    click.option("--model", required=True, help="Built-in model name or package.module:factory."),
    click.option(
        "--norm",
        type=click.Choice(NORMS),
        default="batch",
        show_default=True,
        help="Normalisation of a built-in model: batch (BatchNorm) or group (GroupNorm, "
        "the model MODEL-gn), for the parameter server and DDP alike.",
    ),
    click.option(
        "--workers",
        type=click.IntRange(min=1),
        default=None,
        help="Number of workers (default: one per --slowdowns entry).",
    ),
    click.option(
        "--slowdowns",
        default="1",
        help="Comma-separated slowdown per worker; a single value applies to all.",
    ),
    click.option("--slowdown-schedules", default="", help=SCHEDULES_HELP),
    click.option(
        "--devices",
        default="cpu",
        help="Comma-separated device per worker, or one for all.",
    ),
)


# --links, --server-link and --link-delay: a host and a capped link per node (root).
link_options = _options(
    click.option(
        "--links",
        default=None,
        help="A tc rate per worker (or DDP rank), e.g. 1gbit,1gbit,100mbit, or one for "
        "all: each runs on its own emulated host (a network namespace) whose link is "
        "capped both ways at that rate; needs root.",
    ),
    click.option(
        "--server-link",
        default=None,
        help="The server's link rate (default: the fastest worker link).",
    ),
    click.option(
        "--link-delay",
        default=None,
        help="One-way delay on every link, e.g. 2ms (needs the kernel's netem qdisc).",
    ),
)


# --node-cpus, --server-cpus, --allow-oversubscribe and --cluster: a CPU budget per node
# (root), or a named emulated cluster.
budget_options = _options(
    click.option(
        "--node-cpus",
        default=None,
        help="CPU budget in cores per worker (or DDP rank), comma-separated in "
        "--slowdowns order, one value for all: each runs in its own CPU-quota control "
        "group (root; cgroup v2 cpu.max or v1 cfs quota, 10 ms period). An entry may be "
        "a schedule: its budget, then ;VALUE@N% (a share of the run's work: epochs x "
        "training samples) or ;VALUE@Ns (seconds of training) steps, VALUE a budget, "
        "off (the process is killed) or on (started again with the budget it left "
        "with), e.g. '0.4;0.05@33.3%;0.4@66.7%,0.4;off@33.3%;on@66.7%,0.2,0.1'; the "
        "presets shifting-load and leave-return are such schedules (--cluster).",
    ),
    click.option(
        "--server-cpus",
        type=float,
        default=None,
        help="CPU budget in cores of the server, and of each shard.",
    ),
    click.option(
        "--allow-oversubscribe",
        is_flag=True,
        default=False,
        help="Run budgets that sum to more cores than the machine has (the emulated "
        "nodes then compete for cores).",
    ),
    click.option(
        "--cluster",
        type=click.Choice(sorted(PRESETS)),
        default=None,
        help="A named emulated cluster (options given beside it override it): "
        + "; ".join(f"{name}: {p.description}" for name, p in PRESETS.items())
        + ".",
    ),
)


def warn_unbudgeted_server(nodes: ClusterSpec | None) -> None:
    """Say in one line (on stderr) that the server runs without a CPU budget while workers
    have one."""
    if nodes is not None and nodes.server.cpus is None and any(n.cpus for n in nodes.workers):
        click.echo(
            "pslaunch: warning: --node-cpus without --server-cpus: the server (and each shard) "
            "runs without a CPU budget, on whatever cores the nodes leave",
            err=True,
        )


# The training settings shared with ``pserver start`` (same defaults).
train_options = _options(
    _train("epochs", help="Stop after this many epochs (compare: 5 unless --max-steps is given)."),
    _train("max_steps", help="Stop after this many updates."),
    _train("global_batch", help="Global batch B per update."),
    _train("optimizer", type=click.Choice(OPTIMIZERS), help="Optimizer."),
    _train("lr", help="Learning rate."),
    _train("momentum", help="SGD momentum."),
    _train("nesterov", flag="--nesterov/--no-nesterov", help="Nesterov momentum for SGD."),
    _train("weight_decay", help="L2 weight decay."),
    _train(
        "lr_schedule", type=click.Choice(SCHEDULES), help="Learning-rate schedule over training."
    ),
    _train("warmup_fraction", help="Linear warm-up over this fraction of training."),
    _train("seed", help="Seed for initialisation and shuffling."),
)


# --staleness and --max-staleness, passed to ``pserver start`` (local, compare, slurm).
async_options = _options(
    click.option(
        "--staleness",
        type=click.Choice(STALENESS),
        default=None,
        help="Async staleness function (server default).",
    ),
    click.option(
        "--max-staleness",
        type=click.IntRange(min=0),
        default=None,
        help="Async staleness bound.",
    ),
)


threads_option = click.option(  # local, compare and ddp
    "--threads",
    type=click.IntRange(min=1),
    default=1,
    help="Torch CPU threads per worker (and per DDP rank).",
)
checkpoint_option = click.option(  # ddp and compare
    "--ddp-checkpoint-every",
    type=click.IntRange(min=1),
    default=1,
    help="DDP runs write a checkpoint every E epochs (and when stopped by a signal), which "
    "--resume and the restarts of a node that leaves and returns continue from.",
)
progress_option = click.option(  # local, compare and ddp
    "--progress/--no-progress",
    default=True,
    help="Show a live progress bar (samples trained, epoch, version, latest OA).",
)


# --resume and --overwrite: the one rule for run folders (``common.rundir``), in every
# launcher.
folder_options = _options(
    click.option(
        "--resume",
        is_flag=True,
        help="Continue the run already in the folder (from its newest checkpoint; a "
        "comparison: run only what it has not finished).",
    ),
    click.option(
        "--overwrite",
        is_flag=True,
        help="Replace the run already in the folder; without --resume or --overwrite "
        "a folder holding a run is refused before anything is written.",
    ),
)


# --server-opt and --worker-opt (local, compare and slurm).
extra_options = _options(
    click.option(
        "--server-opt",
        multiple=True,
        help="Extra 'pserver start' option for the parameter-server runs, e.g. "
        "--server-opt=--staleness-a=1.",
    ),
    click.option(
        "--worker-opt",
        multiple=True,
        help="Extra 'worker join' option for every worker of the parameter-server runs, "
        "e.g. --worker-opt=--data=COPY.h5 (read a local copy of the dataset, as DDP's "
        "ranks do).",
    ),
)


# --threads, --server-opt, --worker-opt, --restarts and --progress/--no-progress (local and
# compare).
run_options = _options(
    threads_option,
    extra_options,
    click.option(
        "--restarts",
        type=click.IntRange(min=0),
        default=3,
        help="Start again a server (with its shards) that dies, from its newest checkpoint "
        "(--resume; a checkpoint every epoch's worth of updates unless --server-opt "
        "--checkpoint-every says otherwise), and a worker that dies, each up to N times; "
        "0: never. A clean end or a Ctrl-C/SIGTERM stop is not restarted.",
    ),
    progress_option,
)


CLUSTER_KEYS = ("workers", "slowdowns", "slowdown_schedules", "devices")
EMULATION_KEYS = ("links", "server_link", "link_delay", "cluster", "node_cpus", "server_cpus")


def build_cluster(options: dict[str, Any]) -> dict[str, Any]:
    """Pop ``norm`` and the cluster, link and budget options from ``options`` (setting the
    model ``--norm`` names; ``--allow-oversubscribe`` stays) into what a launcher's
    configuration takes: the per-worker ``slowdowns``, ``slowdown_schedules`` and ``devices``,
    and the emulated ``nodes`` (None when nothing is emulated).

    Without ``--workers`` and with one ``--slowdowns`` value, the worker count is the
    preset's node count, else that of the ``--node-cpus`` or ``--links`` entries.

    Raises:
        click.BadParameter: a value is malformed or the counts disagree, or ``--norm group``
            names a model without a GroupNorm build.
    """
    given = {key: options.pop(key) for key in CLUSTER_KEYS}
    emulated = {key: options.pop(key, None) for key in EMULATION_KEYS}
    workers, slowdowns = given["workers"], given["slowdowns"]
    if workers is None and "," not in slowdowns:
        if emulated["cluster"]:
            workers = len(PRESETS[emulated["cluster"]].node_cpus)
        else:
            listed = [emulated[k] for k in ("node_cpus", "links") if "," in (emulated[k] or "")]
            workers = len(listed[0].split(",")) if listed else None
    try:
        options["model"] = with_norm(options["model"], options.pop("norm"))
        factors, schedules, devices = build_workers(
            workers, slowdowns, given["slowdown_schedules"], given["devices"]
        )
        nodes = parse_cluster(len(factors), preset=emulated.pop("cluster"), **emulated)
    except (ConfigError, ModelError) as exc:
        raise click.BadParameter(str(exc)) from exc
    return {
        "slowdowns": factors,
        "slowdown_schedules": schedules,
        "devices": devices,
        "nodes": nodes,
    }


def build_train(options: dict[str, Any], target_oa: float | None = None) -> TrainSettings:
    """Pop the ``train_options`` from ``options`` into validated ``TrainSettings``.

    Raises:
        click.BadParameter: a value is out of range.
    """
    values = {key: options.pop(key) for key in TRAIN_KEYS}
    try:
        return TrainSettings(**values, target_oa=target_oa).validate()
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from exc


def build_workers(
    workers: int | None, slowdowns: str, schedules: str, devices: str
) -> tuple[tuple[float, ...], tuple[str, ...], tuple[str, ...]]:
    """Per-worker slowdowns, slowdown schedules and devices from the cluster options.

    Without ``--workers`` there is one worker per ``--slowdowns`` entry, or per ``--devices``
    entry when only the devices are listed.

    Raises:
        ConfigError: an option is malformed or the counts disagree.
    """
    device_list = tuple(d.strip() for d in devices.split(",") if d.strip())
    if workers is None and len(device_list) > 1 and "," not in slowdowns.strip(", "):
        workers = len(device_list)
    factors = parse_slowdowns(slowdowns, workers)
    return factors, parse_schedules(schedules, factors), device_list
