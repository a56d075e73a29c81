"""Where a Slurm task runs: the address of its node and the device it computes on."""

from __future__ import annotations

from collections.abc import Mapping

from common.config import need
from common.errors import PSError
from launch.slurm.submit import slurm_command


def pick_device(gpu: bool, env: Mapping[str, str]) -> str:
    """The device of one worker task.

    A task that has GPUs of its own (``--gpus-per-task``) or sees exactly one GPU uses
    ``cuda:0``; tasks that share the GPUs of their node use ``cuda:SLURM_LOCALID`` (modulo the
    GPUs they see).

    Args:
        gpu: the task was given GPUs.
        env: its environment (``CUDA_VISIBLE_DEVICES``, ``SLURM_GPUS_PER_TASK``,
            ``SLURM_LOCALID``).

    Returns:
        ``cpu`` or ``cuda:N``.

    Raises:
        ConfigError: GPUs were requested but ``CUDA_VISIBLE_DEVICES`` lists none.
    """
    if not gpu:
        return "cpu"
    local = int(env.get("SLURM_LOCALID", "0"))
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return f"cuda:{local}"
    count = len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    need(count != 0, f"GPUs were requested but CUDA_VISIBLE_DEVICES is {visible!r}")
    if count == 1 or env.get("SLURM_GPUS_PER_TASK"):
        return "cuda:0"
    return f"cuda:{local % count}"


def node_address(node: str, timeout_s: float = 30.0) -> str:
    """The address Slurm reaches ``node`` at (its ``NodeAddr``), or ``node`` itself.

    Args:
        node: a Slurm node name.
        timeout_s: how long ``scontrol`` may take.

    Returns:
        A host name or IP address.
    """
    try:
        done = slurm_command(["scontrol", "show", "node", "--oneliner", node], timeout_s)
    except (OSError, PSError):
        return node
    for token in done.stdout.split():
        if token.startswith("NodeAddr=") and len(token) > len("NodeAddr="):
            return token.split("=", 1)[1]
    return node
