"""The emulated cluster as the benches take it: ``--cluster PRESET`` or ``--node-cpus`` and
``--server-cpus`` (and ``--allow-oversubscribe``), the options ``pslaunch`` takes."""

from __future__ import annotations

import argparse

from launch.cluster.spec import PRESETS, ClusterSpec, parse_cluster


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the emulated cluster's options to a bench's parser."""
    parser.add_argument(
        "--cluster",
        choices=sorted(PRESETS),
        default=None,
        help="a named emulated cluster (CPU budgets per node; root)",
    )
    parser.add_argument(
        "--node-cpus", default=None, help="CPU budget per worker, e.g. 0.4,0.4,0.2,0.1 (root)"
    )
    parser.add_argument("--server-cpus", type=float, default=None, help="the server's budget")
    parser.add_argument(
        "--allow-oversubscribe",
        action="store_true",
        help="run budgets that sum to more cores than the machine has",
    )


def cluster_from_args(
    args: argparse.Namespace, workers: int, links: str | None = None
) -> ClusterSpec | None:
    """The spec the options give for ``workers`` workers, every node's link at ``links`` if
    given (None: shared cores)."""
    return parse_cluster(workers, args.cluster, args.node_cpus, args.server_cpus, links)


def worker_count(args: argparse.Namespace, slowdowns: str | None) -> int:
    """Workers: one per ``--slowdowns`` entry when several are given, else one per node of
    the preset or of ``--node-cpus``."""
    if slowdowns and "," in slowdowns:
        return len(slowdowns.split(","))
    if args.cluster:
        return len(PRESETS[args.cluster].node_cpus)
    if args.node_cpus:
        return len(args.node_cpus.split(","))
    return 1


def cluster_label(spec: ClusterSpec | None) -> str:
    """How a bench's heading names the cluster it ran on."""
    if spec is None:
        return "shared cores (oversubscribed: every process competes for the same cores)"
    return f"emulated cluster {spec.summary_line()}"
