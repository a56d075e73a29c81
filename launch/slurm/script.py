"""Render a ``SlurmJob`` as a readable, commented ``job.sbatch`` that also works by hand."""

from __future__ import annotations

import shlex
from collections.abc import Iterable

from common.config import escape_control
from launch.slurm.config import DDP, SlurmJob
from launch.slurm.groups import Group

_HEADER = """\
#!/bin/bash
# rs-pserver {kind} job, written by `pslaunch slurm{flag}`. Edit it freely; submit it with
#   sbatch {script}
# Written for:
#   {command}
#
"""

_ABOUT = """\
# The parameter server runs in this script, on the job's first node; the workers run as
# srun steps: {layout}. The job ends when training ends.
# A TERM (scancel, or Slurm's warning {before} s before the time limit: --signal) makes the
# server write a checkpoint and summary.json before it exits{requeue}.
"""

_DDP_ABOUT = """\
# torch DistributedDataParallel with one srun task per rank ({ranks} ranks): the rank is
# SLURM_PROCID, the world size SLURM_NTASKS. Task 0 hosts the rendezvous (a TCPStore) on the
# job's first node, at MASTER_ADDR:MASTER_PORT when those are set, else at that node's Slurm
# address and a port it picks and publishes in RUN_DIR/rendezvous-<job>.<step>. Rank 0
# evaluates after every epoch and writes metrics.jsonl and summary.json in RUN_DIR.
# A DDP run keeps no checkpoint: the job is never requeued, and a cancelled job leaves no
# summary.json.
"""

# A fresh shard secret for each attempt, readable by the job's user alone: the shards prove it
# to the server when they register.
_SECRET = """\
# The secret the shards prove to the server: new for every attempt, for this user only.
SHARD_SECRET=$RUN_DIR/shard-$SLURM_JOB_ID.$ATTEMPT.secret
if ! (set -C && umask 077 && head -c 32 /dev/urandom >"$SHARD_SECRET"); then
    echo "job: cannot write the shard secret $SHARD_SECRET" >&2
    exit 1
fi
SECRET_ARGS=(--shard-secret-file "$SHARD_SECRET")
"""

_SETTINGS = """
set -uo pipefail

# --- settings ----------------------------------------------------------------------------
# A Python with rs-pserver installed, at the same path on every node.
PY={python}
# The run directory (metrics.jsonl, summary.json, {files}logs), seen by every node.
RUN_DIR={run_dir}
"""

_DDP_BODY = """
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
RANKS_LOG=$RUN_DIR/ranks-$SLURM_JOB_ID.log
echo "job $SLURM_JOB_ID: {ranks} DDP ranks on $SLURM_JOB_NODELIST, log $RANKS_LOG"
# --kill-on-bad-exit=1: a rank that fails ends the others (they could only wait for it).
{step} \\
    "$PY" -m launch.slurm.rendezvous --config "$CONFIG" {gpu} >>"$RANKS_LOG" 2>&1
RC=$?
echo "job: the ranks exited with code $RC"
exit "$RC"
"""

_BODY = """\
DATASET={dataset}
# 'pserver start' options (see: $PY -m pserver.cli start --help).
SERVER_ARGS=(
{server_args})
# 'worker join' options for every worker (see: $PY -m worker.cli join --help).
WORKER_ARGS=(
{worker_args})
# Seconds the server may take to start listening, and the workers to leave once it has ended.
STARTUP_TIMEOUT={startup_timeout:g}
STOP_TIMEOUT={stop_timeout:g}
# 1: continue from the newest checkpoint in RUN_DIR (a requeued job always does).
RESUME={resume}
# 1: a TERM while the job is still RUNNING (the time-limit warning, or
# 'scancel --batch --signal=TERM') requeues the job once the server has written its checkpoint.
REQUEUE={requeue}

export PYTHONUNBUFFERED=1
# Options reach the commands below as arguments only: a PSERVER_*, WORKER_* or PSLAUNCH_*
# variable of the submitting shell (sbatch exports its environment) must not change them.
for NAME in $(compgen -e); do
    case $NAME in PSERVER_* | WORKER_* | PSLAUNCH_*) unset "$NAME" ;; esac
done
ATTEMPT=${{SLURM_RESTART_COUNT:-0}}
mkdir -p "$RUN_DIR"

# --- the server, on this node (the job's first) --------------------------------------------
# MASTER_ADDR and MASTER_PORT, when set, are the address and port it listens on; by default
# this node's Slurm address (NodeAddr) and a free port.
FIRST_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
NODE_ADDR=$(scontrol show node "$FIRST_NODE" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
SERVER_HOST=${{MASTER_ADDR:-${{NODE_ADDR:-$FIRST_NODE}}}}
SERVER_PORT=${{MASTER_PORT:-0}}
RESUME_ARGS=()
if [[ $RESUME == 1 ]] \\
    || {{ ((ATTEMPT > 0)) && compgen -G "$RUN_DIR/checkpoints/ckpt-*.npz" >/dev/null; }}; then
    RESUME_ARGS=(--resume)
fi
SERVER_LOG=$RUN_DIR/server-$SLURM_JOB_ID.$ATTEMPT.log
{secret}# Only "start" events written after this offset are this attempt's server's.
EVENTS_OFFSET=$(stat -c %s "$RUN_DIR/metrics.jsonl" 2>/dev/null || echo 0)
echo "job $SLURM_JOB_ID (attempt $ATTEMPT): server on $FIRST_NODE, log $SERVER_LOG"
echo "job: {nodes}"
"$PY" -m pserver.cli start --bind "tcp://$SERVER_HOST:$SERVER_PORT" --dataset "$DATASET" \\
    --run-dir "$RUN_DIR" "${{SERVER_ARGS[@]}}" "${{RESUME_ARGS[@]}}" "${{SECRET_ARGS[@]}}" \\
    >"$SERVER_LOG" 2>&1 &
SERVER_PID=$!

# A TERM to this script alone (Slurm's time-limit warning, or 'scancel --batch') goes on to
# the server, which writes a checkpoint and summary.json and stops the workers. After a plain
# 'scancel' (job no longer RUNNING) Slurm signals the server itself; a second TERM would cut
# its shutdown short, so none is sent.
STOPPED=0
on_term() {{
    local state
    state=$(squeue -h -j "$SLURM_JOB_ID" -o %T 2>/dev/null | head -n 1)
    if [[ $state == CANCELLED || $state == COMPLETING ]]; then
        echo "job: cancelled; Slurm stops the server and the workers"
        return
    fi
    [[ $state == RUNNING ]] && STOPPED=1
    echo "job: TERM received (job ${{state:-state unknown}}); stopping the server"
    kill -TERM "$SERVER_PID" 2>/dev/null
}}
trap on_term TERM

# The address workers connect to: this server's "start" event in metrics.jsonl.
if ! ADDRESS=$("$PY" -m launch.slurm.node address --run-dir "$RUN_DIR" --offset "$EVENTS_OFFSET" \\
    --pid "$SERVER_PID" --timeout "$STARTUP_TIMEOUT"); then
    echo "job: the server did not start; the end of $SERVER_LOG:" >&2
    tail -n 30 "$SERVER_LOG" >&2
    kill -TERM "$SERVER_PID" 2>/dev/null
    wait "$SERVER_PID"
    exit 1
fi
echo "job: the server listens on $ADDRESS"
{shards}
# --- the workers ---------------------------------------------------------------------------
# Each task runs 'worker join' with its own slowdown, name and device: launch.slurm.node
# reads SLURM_PROCID, SLURM_LOCALID and CUDA_VISIBLE_DEVICES (a task that sees one GPU uses
# cuda:0; tasks sharing a node's GPUs use cuda:SLURM_LOCALID).
WORKERS_LOG=$RUN_DIR/workers-$SLURM_JOB_ID.$ATTEMPT.log
(
{steps}
    wait
    # Every worker has ended. Training normally ended first; if the server still runs (all
    # workers failed), stop it after STOP_TIMEOUT seconds.
    timeout "$STOP_TIMEOUT" tail --pid="$SERVER_PID" -f /dev/null || kill -TERM "$SERVER_PID"
) >>"$WORKERS_LOG" 2>&1 &
WORKERS_PID=$!

# --- the end ------------------------------------------------------------------------------
STEP_PIDS=("$WORKERS_PID" "${{SHARD_PIDS[@]}}")
# 'wait' returns early when a TERM arrives: wait again until the server has really exited.
wait_for() {{
    while kill -0 "$1" 2>/dev/null; do wait "$1"; done
    wait "$1"
}}
wait_for "$SERVER_PID"
SERVER_RC=$?
echo "job: the server exited with code $SERVER_RC"
[[ -n $SHARD_SECRET ]] && rm -f "$SHARD_SECRET"
# The workers (and shards) were told to stop; Slurm ends any step still running when this
# script exits.
for pid in "${{STEP_PIDS[@]}}"; do
    timeout "$STOP_TIMEOUT" tail --pid="$pid" -f /dev/null \\
        || echo "job: steps still running $STOP_TIMEOUT s after the server; ending the job"
done
# A server that died (killed, crashed or failed: not a clean end, not a stop) is restarted the
# same way when it left a checkpoint; Slurm's MaxBatchRequeue bounds how often.
case $SERVER_RC in 0 | 130 | 143) DIED=0 ;; *) DIED=1 ;; esac
if [[ $DIED == 1 ]] && compgen -G "$RUN_DIR/checkpoints/ckpt-*.npz" >/dev/null; then
    STOPPED=1
fi
if [[ $STOPPED == 1 && $REQUEUE == 1 ]]; then
    STATE=$(squeue -h -j "$SLURM_JOB_ID" -o %T 2>/dev/null | head -n 1)
    if [[ $STATE == RUNNING ]]; then
        echo "job: stopped or died while running; requeueing (the next run resumes)"
        scontrol requeue "$SLURM_JOB_ID"
    fi
fi
exit "$SERVER_RC"
"""


def _quote_lines(args: Iterable[str]) -> str:
    """Options as bash array items, one option (with its value) per line."""
    lines: list[list[str]] = []
    for arg in args:
        if arg.startswith("--") or not lines:
            lines.append([arg])
        else:
            lines[-1].append(arg)
    return "".join("    " + " ".join(shlex.quote(a) for a in line) + "\n" for line in lines)


def resources(group: Group) -> list[str]:
    """The resource options shared by a group's ``#SBATCH`` lines and its srun step.

    Args:
        group: the worker group.

    Returns:
        Options such as ``--ntasks=2``, ``--cpus-per-task=1``, ``--gpus-per-task=1``.
    """
    options = [f"--ntasks={group.workers}", f"--cpus-per-task={group.cpus}"]
    if group.nodes is not None:
        options.append(f"--nodes={group.nodes}")
    if group.tasks_per_node is not None:
        options.append(f"--ntasks-per-node={group.tasks_per_node}")
    if group.gpus_per_worker:
        options.append(f"--gpus-per-task={group.gpus_per_worker}")
    if group.gpus_per_node:
        options.append(f"--gpus-per-node={group.gpus_per_node}")
    return options


def placement(partition: str | None, constraint: str | None) -> list[str]:
    """``--partition`` and ``--constraint`` options for the given values (None: left out)."""
    options = []
    if partition:
        options.append(f"--partition={partition}")
    if constraint:
        options.append(f"--constraint={constraint}")
    return options


def _sbatch_lines(job: SlurmJob) -> list[str]:
    """The ``#SBATCH`` block: job-wide options, then one block per component."""
    run_dir = job.run_dir  # checked: no characters that need quoting
    ddp = job.mode == DDP
    common = [
        f"--job-name={job.job_name}",
        f"--output={run_dir}/slurm-%j.out",
        "--open-mode=append",
        f"--time={job.time}",
        *([] if ddp else [f"--signal=B:TERM@{job.signal_before_s}"]),
        "--requeue" if job.requeue and not ddp else "--no-requeue",
        *job.sbatch_options,
    ]
    if ddp:
        lines = ["# Job-wide: name, log, time limit, no requeue; then one task per rank."]
    else:
        lines = ["# Job-wide: name, log, time limit, the TERM before it, requeue."]
    lines += [f"#SBATCH {o}" for o in common]
    if not job.het:
        group = job.groups[0]
        if not ddp:
            lines.append(
                f"# {group.workers} workers, one task each; the server shares the first node."
            )
        lines += [f"#SBATCH {o}" for o in placement(job.partition, group.constraint)]
        lines += [f"#SBATCH {o}" for o in resources(group)]
        return lines
    if job.server is not None:
        place = job.server
        lines.append("# Component 0: the server alone.")
        lines += [f"#SBATCH {o}" for o in placement(place.partition, place.constraint)]
        lines += ["#SBATCH --nodes=1", "#SBATCH --ntasks=1"]
        lines.append(f"#SBATCH --cpus-per-task={place.cpus}")
    for index, group in enumerate(job.groups):
        component = index + (job.server is not None)
        if component > 0:
            lines.append("#SBATCH hetjob")
        where = " (the server shares its first node)" if component == 0 else ""
        lines.append(f"# Component {component}: workers {group.name!r}{where}.")
        lines += [f"#SBATCH {o}" for o in placement(group.partition, group.constraint)]
        lines += [f"#SBATCH {o}" for o in resources(group)]
    return lines


def _het_group(job: SlurmJob, index: int) -> list[str]:
    """``--het-group`` of the ``index``-th worker group's component (none in a plain job)."""
    return [f"--het-group={index + (job.server is not None)}"] if job.het else []


def _step(job: SlurmJob, index: int, group: Group) -> str:
    """One srun step running a group's workers in the background."""
    options = [*_het_group(job, index), *resources(group), "--kill-on-bad-exit=0", "--label"]
    factors = [f"{f:g}" for f in group.slowdowns]
    slowdowns = factors[0] if len(set(factors)) == 1 else ",".join(factors)
    prefix = "w" if not job.het else f"{group.name}-w"
    gpu = "--gpu" if group.gpus else "--no-gpu"
    return (
        f"    # group {group.name!r}: {group.workers} worker(s), slowdown {slowdowns}\n"
        + wrap(["srun", *options], "    ")
        + " \\\n"
        f'        "$PY" -m launch.slurm.node worker --name-prefix {prefix} '
        f"--slowdowns {slowdowns} {gpu} -- \\\n"
        f'        --server "$ADDRESS" --threads {group.cpus} "${{WORKER_ARGS[@]}}" &'
    )


def wrap(words: list[str], indent: str, width: int = 96) -> str:
    """Words joined into shell lines of at most ``width`` characters, continued with '\\'."""
    lines = [indent + words[0]]
    for word in words[1:]:
        if len(lines[-1]) + 1 + len(word) > width:
            lines[-1] += " \\"
            lines.append(indent + "    " + word)
        else:
            lines[-1] += " " + word
    return "\n".join(lines)


def _nodes_line(job: SlurmJob) -> str:
    """An echo of where the job runs: its nodes, or each component's nodes."""
    if not job.het:
        return "nodes $SLURM_JOB_NODELIST"
    count = len(job.groups) + (job.server is not None)
    return "components on " + ",".join(
        f"${{SLURM_JOB_NODELIST_HET_GROUP_{i}}}" for i in range(count)
    )


def _shards(job: SlurmJob) -> str:
    """The shard servers' srun steps (none without shards)."""
    lines = [
        "",
        "# --- parameter shards, on the workers' nodes ----------------------------------------",
    ]
    if job.shards < 2:
        lines.append("# None: the server keeps the parameters (pslaunch slurm --shards K).")
        return "\n".join([*lines, "SHARD_PIDS=()"]) + "\n"
    lines += [
        f"# {job.shards} 'pserver shard' servers hold 1/{job.shards} of the state each, spread "
        "one per node\n# (--distribution=cyclic) next to the workers; the server waits for all "
        "of them.",
        "SHARD_PIDS=()",
        "SHARDS_LOG=$RUN_DIR/shards-$SLURM_JOB_ID.$ATTEMPT.log",
    ]
    for index, group in enumerate(job.groups):
        if not group.shards:
            continue
        options = [*_het_group(job, index), "--overlap", f"--ntasks={group.shards}"]
        options += ["--cpus-per-task=1", "--distribution=cyclic", "--kill-on-bad-exit=0", "--label"]
        prefix = "shard" if not job.het else f"{group.name}-shard"
        lines += [
            wrap(["srun", *options], "") + " \\",
            f'    "$PY" -m launch.slurm.node shard --name-prefix {prefix} -- '
            '--coordinator "$ADDRESS" \\',
            '    --secret-file "$SHARD_SECRET" --connect-timeout "$STARTUP_TIMEOUT" '
            '>>"$SHARDS_LOG" 2>&1 &',
            "SHARD_PIDS+=($!)",
        ]
    return "\n".join(lines) + "\n"


def server_args(job: SlurmJob) -> tuple[str, ...]:
    """The ``pserver start`` options of the job, without bind, dataset, run dir and resume."""
    shards = ("--shards", str(job.shards)) if job.shards > 1 else ()
    own = ("--model", job.model, "--mode", job.mode, "--workers", str(job.workers), *shards)
    return (*own, *job.train.server_args(), *job.server_options)


def worker_extras(job: SlurmJob) -> tuple[str, ...]:
    """``worker join`` options the launcher adds for every worker.

    ``--connect-timeout`` covers the server's start-up (and the shards' registration);
    ``--allow-model`` lets workers build the user's own model (built-in models need none).

    Args:
        job: the job (its model and start-up timeout).

    Returns:
        The options.
    """
    extras = ["--connect-timeout", f"{job.startup_timeout_s:g}"]
    if ":" in job.model:
        extras += ["--allow-model", job.model]
    return tuple(extras)


def _server_body(job: SlurmJob) -> str:
    """The script after its settings' first lines: the server, its shards and workers."""
    steps = "\n".join(_step(job, i, g) for i, g in enumerate(job.groups))
    return _BODY.format(
        dataset=shlex.quote(str(job.dataset)),
        server_args=_quote_lines(server_args(job)),
        worker_args=_quote_lines((*worker_extras(job), *job.worker_options)),
        startup_timeout=job.startup_timeout_s,
        stop_timeout=job.stop_timeout_s,
        resume=int(job.resume),
        requeue=int(job.requeue),
        nodes=_nodes_line(job),
        shards=_shards(job),
        secret=_SECRET if job.shards > 1 else "SHARD_SECRET=\nSECRET_ARGS=()\n",
        steps=steps,
    )


def _ddp_body(job: SlurmJob) -> str:
    """The script after its settings' first lines: the DDP ranks as one srun step."""
    group = job.groups[0]
    return _DDP_BODY.format(
        config=job.ddp_config().to_json(),
        ranks=group.workers,
        step=wrap(["srun", *resources(group), "--kill-on-bad-exit=1", "--label"], ""),
        gpu="--gpu" if group.gpus else "--no-gpu",
    )


def render(job: SlurmJob, command: str, script: str) -> str:
    """The job script's text: a parameter-server run, or DDP ranks (mode ``ddp``).

    Args:
        job: the validated job.
        command: the command line that made it (quoted in the header).
        script: where the script is written (quoted in the header).

    Returns:
        The complete script.
    """
    ddp = job.mode == DDP
    head = _HEADER.format(
        kind="DDP" if ddp else "training",
        flag=" --mode ddp" if ddp else "",
        script=script,
        command=escape_control(command),
    )
    if ddp:
        head += _DDP_ABOUT.format(ranks=job.workers)
    else:
        head += _ABOUT.format(
            layout=f"one srun step per component, {job.workers} tasks in all"
            if job.het
            else f"one srun step, one task per worker, {job.workers} tasks",
            before=job.signal_before_s,
            requeue=";\n# after the time-limit warning the job is requeued and resumes"
            if job.requeue
            else "",
        )
    settings = _SETTINGS.format(
        python=shlex.quote(job.python),
        run_dir=shlex.quote(str(job.run_dir)),
        files="" if ddp else "checkpoints/, ",
    )
    body = _ddp_body(job) if ddp else _server_body(job)
    return head + "\n".join(_sbatch_lines(job)) + "\n" + settings + body
