"""Render a ``SlurmJob`` of mode ``ddp`` as a readable ``job.sbatch``: DDP ranks as srun tasks."""

from __future__ import annotations

import shlex

from common.config import escape_control
from launch.slurm.config import SlurmJob
from launch.slurm.script import placement, resources, wrap

RANKS_LOG = "ranks-$SLURM_JOB_ID.log"

_TEMPLATE = """\
#!/bin/bash
# rs-pserver DDP baseline job, written by `pslaunch slurm --mode ddp`. Edit it freely; submit
# it with
#   sbatch {script}
# Written for:
#   {command}
#
# torch DistributedDataParallel with one srun task per rank ({ranks} ranks): the rank is
# SLURM_PROCID, the world size SLURM_NTASKS. Task 0 hosts the rendezvous (a TCPStore) on the
# job's first node, at MASTER_ADDR:MASTER_PORT when those are set, else at that node's Slurm
# address and a port it picks and publishes in RUN_DIR/rendezvous-<job>.<step>. Rank 0
# evaluates after every epoch and writes metrics.jsonl and summary.json in RUN_DIR.
# A DDP run keeps no checkpoint: the job is never requeued, and a cancelled job leaves no
# summary.json.
{sbatch}

set -uo pipefail

# --- settings ----------------------------------------------------------------------------
# A Python with rs-pserver installed, at the same path on every node.
PY={python}
# The run directory (metrics.jsonl, summary.json, logs), seen by every node.
RUN_DIR={run_dir}

export PYTHONUNBUFFERED=1
mkdir -p "$RUN_DIR"
# The run's settings, read by every rank (launch.ddp.config.DDPConfig): dataset, model,
# one slowdown per rank, the training settings shared with the parameter server, timeouts.
# "run_dir" must name RUN_DIR. The job writes the file when it starts: edit the settings here.
CONFIG=$RUN_DIR/ddp_config.json
cat >"$CONFIG" <<'END_OF_CONFIG'
{config}
END_OF_CONFIG

# --- the ranks ----------------------------------------------------------------------------
RANKS_LOG=$RUN_DIR/{ranks_log}
echo "job $SLURM_JOB_ID: {ranks} DDP ranks on $SLURM_JOB_NODELIST, log $RANKS_LOG"
# --kill-on-bad-exit=1: a rank that fails ends the others (they could only wait for it).
{step} \\
    "$PY" -m launch.slurm.node ddp --config "$CONFIG" {gpu} >>"$RANKS_LOG" 2>&1
RC=$?
echo "job: the ranks exited with code $RC"
exit "$RC"
"""


def _sbatch_lines(job: SlurmJob) -> list[str]:
    """The ``#SBATCH`` block: name, log, time limit, no requeue, then the ranks' resources."""
    group = job.groups[0]
    options = [
        f"--job-name={job.job_name}",
        f"--output={job.run_dir}/slurm-%j.out",
        "--open-mode=append",
        f"--time={job.time}",
        "--no-requeue",
        *job.sbatch_options,
        *placement(job.partition, group.constraint),
        *resources(group),
    ]
    return [
        "# Job-wide: name, log, time limit, no requeue; then one task per rank.",
        *(f"#SBATCH {o}" for o in options),
    ]


def render_ddp(job: SlurmJob, command: str, script: str) -> str:
    """The job script of a DDP job.

    Args:
        job: the validated job (mode ``ddp``).
        command: the command line that made it (quoted in the header).
        script: where the script is written (quoted in the header).

    Returns:
        The complete script.
    """
    group = job.groups[0]
    step = ["srun", *resources(group), "--kill-on-bad-exit=1", "--label"]
    return _TEMPLATE.format(
        script=script,
        command=escape_control(command),
        ranks=group.workers,
        sbatch="\n".join(_sbatch_lines(job)),
        python=shlex.quote(job.python),
        run_dir=shlex.quote(str(job.run_dir)),
        config=job.ddp_config().to_json(),
        ranks_log=RANKS_LOG,
        step=wrap(step, ""),
        gpu="--gpu" if group.gpus else "--no-gpu",
    )
