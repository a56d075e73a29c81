"""pslaunch slurm without a cluster: --het parsing, time limits, the job script, in-job helpers."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from common.errors import ConfigError, NetworkTimeout, PSError
from launch.cli import main
from launch.settings import TrainSettings
from launch.slurm.config import SlurmJob, time_limit_s
from launch.slurm.groups import Group, parse_het, spread_shards
from launch.slurm.node import address, pick_device, shard_command, worker_command
from launch.slurm.node import main as node_main
from launch.slurm.script import render, resources, worker_extras
from launch.slurm.submit import check_run_dir


def _job(tmp_path: Path, **changes: object) -> SlurmJob:
    values: dict[str, object] = {
        "dataset": tmp_path / "data.h5",
        "model": "hsi-cnn",
        "mode": "weighted-sync",
        "run_dir": tmp_path / "run",
        "groups": (Group("workers", (1.0, 2.0)),),
        "train": TrainSettings(epochs=3),
    }
    values.update(changes)
    return SlurmJob(**values).validate()  # type: ignore[arg-type]


def _bash_syntax_ok(text: str, tmp_path: Path) -> bool:
    script = tmp_path / "check.sbatch"
    script.write_text(text)
    return subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


# --- --het ---------------------------------------------------------------------------------


def test_het_spec_of_the_issue() -> None:
    server, groups = parse_het(
        "server:partition=cpu;gpu-workers:partition=gpu,nodes=2,gpus=4;"
        "cpu-workers:partition=cpu,nodes=4"
    )
    assert server is not None and server.partition == "cpu"
    gpu, cpu = groups
    # gpus=4 on 2 nodes: 4 workers per node, one GPU each.
    assert (gpu.workers, gpu.nodes, gpu.tasks_per_node, gpu.gpus_per_worker) == (8, 2, 4, 1)
    assert gpu.partition == "gpu" and gpu.gpus
    assert (cpu.workers, cpu.nodes, cpu.gpus, cpu.partition) == (4, 4, False, "cpu")


def test_het_workers_share_the_node_gpus_when_counted() -> None:
    _, (group,) = parse_het("g:gpus=2,workers=6,nodes=2,cpus=4,slowdown=1.5")
    assert group.workers == 6 and group.gpus_per_node == 2 and group.gpus_per_worker == 0
    assert group.cpus == 4 and group.slowdowns == (1.5,) * 6
    assert "--gpus-per-node=2" in resources(group) and "--ntasks=6" in resources(group)


def test_het_without_server_component() -> None:
    server, groups = parse_het("a:workers=2;b:slowdown=3")
    assert server is None and [g.workers for g in groups] == [2, 1]
    assert groups[1].slowdowns == (3.0,)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("a:colour=red", "unknown key 'colour'"),
        ("a:nodes=two", "nodes='two' is not a whole number"),
        ("a:nodes=1,nodes=2", "nodes is given twice"),
        ("a:nodes", "'nodes' is not key=value"),
        ("a:partition=x y", "characters Slurm does not take"),
        ("a:workers=1;server:cpus=2", "'server' component must come first"),
        ("server:cpus=2", "has no worker component"),
        ("server:gpus=1;a:workers=1", "unknown key 'gpus'"),
        ("a:workers=1;a:workers=2", "names component 'a' twice"),
        ("1a:workers=1", "must start with a letter"),
        ("a:workers=0", "has no workers"),
        ("a:workers=2,nodes=3", "nodes must be between 1 and its 2 workers"),
        ("a:gpus=2,gpus-per-worker=1,workers=2", "not both"),
        ("a:slowdown=0.5", "slowdowns must be >= 1"),
        ("a:slowdown=fast", "'fast' is not a number"),
    ],
)
def test_het_spec_errors_name_the_problem(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_het(spec)


# --- the job -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30", 1800),
        ("5:30", 330),
        ("01:00:00", 3600),
        ("2-00", 172800),
        ("1-02:03", 93780),
        ("1-00:00:05", 86405),
    ],
)
def test_slurm_time_formats(text: str, seconds: int) -> None:
    assert time_limit_s(text) == seconds


def test_job_validation(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is not a Slurm time"):
        _job(tmp_path, time="1h")
    with pytest.raises(ConfigError, match="leaves no time to train"):
        _job(tmp_path, time="2", signal_before_s=120)
    with pytest.raises(ConfigError, match="absolute path"):
        _job(tmp_path, dataset=Path("data.h5"))
    with pytest.raises(ConfigError, match="without spaces"):
        _job(tmp_path, run_dir=tmp_path / "my run")
    with pytest.raises(ConfigError, match="one '--name"):
        _job(tmp_path, sbatch_options=("account=x",))
    with pytest.raises(ConfigError, match="one worker group"):
        _job(tmp_path, groups=(Group("a", (1.0,)), Group("b", (1.0,))))


def test_plain_script(tmp_path: Path) -> None:
    job = _job(
        tmp_path,
        groups=(Group("workers", (1.0, 2.0, 4.0), cpus=2, nodes=3, gpus_per_worker=1),),
        partition="gpu",
        sbatch_options=("--account=rs1",),
        server_options=("--checkpoint-every", "50"),
        worker_options=("--data=/scratch/copy.h5",),
        model="mypkg.nets:make",
    )
    text = render(job, "pslaunch slurm ...", "/x/job.sbatch")
    assert _bash_syntax_ok(text, tmp_path)
    sbatch = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert sbatch == [
        "#SBATCH --job-name=rs-pserver",
        f"#SBATCH --output={tmp_path}/run/slurm-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --time=01:00:00",
        "#SBATCH --signal=B:TERM@180",
        "#SBATCH --requeue",
        "#SBATCH --account=rs1",
        "#SBATCH --partition=gpu",
        "#SBATCH --ntasks=3",
        "#SBATCH --cpus-per-task=2",
        "#SBATCH --nodes=3",
        "#SBATCH --gpus-per-task=1",
    ]
    assert "--workers 3" in text and "--checkpoint-every 50" in text
    assert "--allow-model mypkg.nets:make" in text and "--data=/scratch/copy.h5" in text
    assert "--slowdowns 1,2,4 --gpu" in text and "--threads 2" in text
    assert "--het-group" not in text
    # The executable part comes after every #SBATCH line (sbatch stops reading at a command).
    first_command = next(
        i for i, line in enumerate(text.splitlines()) if line and not line.startswith("#")
    )
    last_sbatch = max(i for i, line in enumerate(text.splitlines()) if line.startswith("#SBATCH"))
    assert last_sbatch < first_command


@pytest.mark.parametrize(
    ("code", "checkpoint", "requeued"),
    [(137, True, True), (1, True, True), (137, False, False), (0, True, False), (143, True, False)],
)
def test_a_server_that_died_requeues_the_job_when_it_left_a_checkpoint(
    tmp_path: Path, code: int, checkpoint: bool, requeued: bool
) -> None:
    """The script's end, run by bash with Slurm's commands as functions: a server killed (137)
    or failed (1) requeues the job when a checkpoint exists; a clean end or a stop does not."""
    text = render(_job(tmp_path), "pslaunch slurm ...", "/x/job.sbatch")
    end = text[text.index("# A server that died") : text.index('exit "$SERVER_RC"')]
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    if checkpoint:
        (run_dir / "checkpoints" / "ckpt-0000000009.npz").write_bytes(b"")
    stubs = 'squeue() { echo RUNNING; }\nscontrol() { echo "scontrol $*"; }\n'
    values = f"SERVER_RC={code}\nSTOPPED=0\nREQUEUE=1\nSLURM_JOB_ID=7\nRUN_DIR={run_dir}\n"
    done = subprocess.run(["bash", "-c", stubs + values + end], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert ("scontrol requeue 7" in done.stdout) == requeued, done.stdout


def test_het_script(tmp_path: Path) -> None:
    server, groups = parse_het("server:cpus=2,partition=cpu;gpu:gpus=2,nodes=1;cpu:workers=3")
    job = _job(tmp_path, groups=groups, server=server, het=True, requeue=False)
    text = render(job, "pslaunch slurm ...", "/x/job.sbatch")
    assert _bash_syntax_ok(text, tmp_path)
    blocks = text.split("#SBATCH hetjob")
    assert len(blocks) == 3
    assert "#SBATCH --partition=cpu" in blocks[0] and "#SBATCH --ntasks=1" in blocks[0]
    assert "#SBATCH --cpus-per-task=2" in blocks[0] and "#SBATCH --no-requeue" in blocks[0]
    assert "#SBATCH --ntasks-per-node=2" in blocks[1] and "--gpus-per-task=1" in blocks[1]
    assert "#SBATCH --ntasks=3" in blocks[2]
    assert "srun --het-group=1 " in text and "srun --het-group=2 " in text
    assert "--name-prefix gpu-w" in text and "--name-prefix cpu-w" in text
    assert "--workers 5" in text  # the server waits for every component's workers
    assert "REQUEUE=0" in text


def test_het_script_without_server_component(tmp_path: Path) -> None:
    _, groups = parse_het("a:workers=2;b:slowdown=2")
    text = render(_job(tmp_path, groups=groups, het=True), "c", "s")
    assert text.count("#SBATCH hetjob") == 1
    assert "srun --het-group=0 " in text and "srun --het-group=1 " in text
    assert "server shares its first node" in text


def test_worker_extras(tmp_path: Path) -> None:
    job = _job(tmp_path, model="mypkg.nets:make", startup_timeout_s=90)
    assert worker_extras(job) == ("--connect-timeout", "90", "--allow-model", "mypkg.nets:make")
    assert worker_extras(_job(tmp_path)) == ("--connect-timeout", "300")


def test_check_run_dir(tmp_path: Path) -> None:
    check_run_dir(tmp_path, resume=False)  # empty: fine
    (tmp_path / "job.sbatch").write_text("")  # launcher files do not make a run
    check_run_dir(tmp_path, resume=False)
    with pytest.raises(ConfigError, match="holds no checkpoint"):
        check_run_dir(tmp_path, resume=True)
    (tmp_path / "metrics.jsonl").write_text('{"event": "start"}\n')  # a failed start's
    check_run_dir(tmp_path, resume=False)
    (tmp_path / "metrics.jsonl").write_text('{"event": "start"}\n{"event": "round"}\n')
    with pytest.raises(ConfigError, match="already holds a run"):
        check_run_dir(tmp_path, resume=False)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "ckpt-0000000007.npz").write_bytes(b"")
    check_run_dir(tmp_path, resume=True)


def test_cli_writes_the_script_without_submitting(tmp_path: Path) -> None:
    data = tmp_path / "data.h5"
    data.write_bytes(b"")
    run_dir = tmp_path / "run"
    args = ["slurm", "--dataset", str(data), "--model", "hsi-cnn", "--run-dir", str(run_dir)]
    result = CliRunner().invoke(main, [*args, "--slowdowns", "1,3", "--epochs", "2"])
    assert result.exit_code == 0, result.output
    assert "submit it with: sbatch" in result.output
    text = (run_dir / "job.sbatch").read_text()
    assert "#SBATCH --ntasks=2" in text and "--slowdowns 1,3" in text
    bad = CliRunner().invoke(main, [*args, "--epochs", "2", "--het", "a:colour=red"])
    assert bad.exit_code != 0 and "unknown key 'colour'" in bad.output
    assert "Traceback" not in bad.output
    env = CliRunner().invoke(main, [*args, "--epochs", "2"], env={"PSLAUNCH_SLURM_TIME": "0:30:00"})
    assert env.exit_code == 0 and "#SBATCH --time=0:30:00" in (run_dir / "job.sbatch").read_text()
    mixed = CliRunner().invoke(
        main,
        [*args, "--epochs", "2", "--het", "a:workers=2", "--slowdowns", "1,2"],
    )
    assert mixed.exit_code != 0 and "per component" in mixed.output


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--partition", "gpu\ntouch /tmp/pwned"),
        ("--worker-opt", "--data=/a\ntouch /tmp/pwned"),
        ("--server-opt", "--checkpoint-every=5\rtouch /tmp/pwned"),
        ("--sbatch-opt", "--account=a\x00b"),
        ("--python", "/usr/bin/python3\x1b"),
    ],
)
def test_control_characters_are_refused_naming_the_option(
    tmp_path: Path, option: str, value: str
) -> None:
    data = tmp_path / "data.h5"
    data.write_bytes(b"")
    run_dir = tmp_path / "run"
    args = ["slurm", "--dataset", str(data), "--model", "hsi-cnn", "--run-dir", str(run_dir)]
    result = CliRunner().invoke(main, [*args, "--epochs", "2", option, value])
    assert result.exit_code != 0
    assert f"Error: {option} " in result.output and "control characters" in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert not (run_dir / "job.sbatch").exists()


def test_a_newline_in_the_dataset_path_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data\nid\n.h5"
    data.write_bytes(b"")
    args = ["slurm", "--dataset", str(data), "--model", "hsi-cnn", "--epochs", "2"]
    result = CliRunner().invoke(main, [*args, "--run-dir", str(tmp_path / "run")])
    assert result.exit_code != 0 and "Error: --dataset " in result.output
    assert "control characters" in result.output
    with pytest.raises(ConfigError, match="--dataset"):
        _job(tmp_path, dataset=data)
    with pytest.raises(ConfigError, match="--model"):
        _job(tmp_path, model="pkg.mod:f\nid", mode="ddp")


def test_script_comments_and_values_cannot_start_a_shell_line(tmp_path: Path) -> None:
    """Quotes and $() stay inside their quotes; the command in the header comment stays one
    comment line whatever it holds."""
    job = _job(tmp_path, worker_options=("--name=$(id)'\"",), partition="p$(id)")
    text = render(job, "pslaunch slurm --x 'a\nid'\r\x00", "s")
    assert _bash_syntax_ok(text, tmp_path)
    lines = text.splitlines()
    assert all(not line.startswith("id") for line in lines)
    assert "#   pslaunch slurm --x 'a\\nid'\\r\\x00" in lines
    assert "    " + shlex.quote("--name=$(id)'\"") in lines


# --- helpers run inside the job ------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpu", "env", "device"),
    [
        (False, {"CUDA_VISIBLE_DEVICES": "0"}, "cpu"),
        (True, {"CUDA_VISIBLE_DEVICES": "3", "SLURM_LOCALID": "1"}, "cuda:0"),
        (True, {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "SLURM_LOCALID": "2"}, "cuda:2"),
        (True, {"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_LOCALID": "3"}, "cuda:1"),
        (
            True,
            {"CUDA_VISIBLE_DEVICES": "4,5", "SLURM_LOCALID": "1", "SLURM_GPUS_PER_TASK": "2"},
            "cuda:0",
        ),
        (True, {"SLURM_LOCALID": "2"}, "cuda:2"),
    ],
)
def test_pick_device(gpu: bool, env: dict[str, str], device: str) -> None:
    assert pick_device(gpu, env) == device


def test_pick_device_refuses_no_visible_gpu() -> None:
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES"):
        pick_device(True, {"CUDA_VISIBLE_DEVICES": ""})


def test_worker_command_per_task() -> None:
    env = {"SLURM_PROCID": "1", "SLURM_LOCALID": "0"}
    argv = worker_command("fast-w", "1,2.5", False, env, ("--server", "tcp://h:1"))
    assert argv[:4] == [sys.executable, "-m", "worker.cli", "join"]
    assert argv[4:] == [
        "--name",
        "fast-w1-x2.5",
        "--slowdown",
        "2.5",
        "--device",
        "cpu",
        "--server",
        "tcp://h:1",
    ]
    assert "w3-x2" in worker_command("w", "2", False, {"SLURM_PROCID": "3"}, ())
    with pytest.raises(ConfigError, match="task 2 has no slowdown"):
        worker_command("w", "1,2", False, {"SLURM_PROCID": "2"}, ())
    with pytest.raises(ConfigError, match="inside an srun step"):
        worker_command("w", "1", False, {}, ())


def _write_events(path: Path, *records: dict) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


FAKE_SERVER = """
import json, sys, time
run_dir, delay, listen = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "1"
time.sleep(delay)
if listen:
    with open(run_dir + "/metrics.jsonl", "a") as f:
        f.write(json.dumps({"event": "start", "t": 0, "address": "tcp://127.0.0.1:4242"}) + "\\n")
    time.sleep(30)
"""


def _node_address(metrics: Path, offset: int, pid: int, timeout_s: float) -> str:
    """What ``python -m launch.slurm.node address`` prints, or the error it stops on."""
    runner = CliRunner()
    args = ["--run-dir", str(metrics.parent), "--offset", str(offset), "--pid", str(pid)]
    done = runner.invoke(address, [*args, "--timeout", str(timeout_s)], standalone_mode=False)
    if done.exception is not None:
        raise done.exception.__cause__ or done.exception
    return done.output.strip()


def _fake_server(tmp_path: Path, delay: float, listen: bool) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", FAKE_SERVER, str(tmp_path), str(delay), str(int(listen))]
    )


def test_node_address_of_a_server_that_starts(tmp_path: Path) -> None:
    # An older attempt's start event (before the offset) must not be taken, nor a line still
    # being written.
    metrics = tmp_path / "metrics.jsonl"
    _write_events(metrics, {"event": "start", "t": 0, "address": "tcp://old:1"})
    offset = metrics.stat().st_size
    proc = _fake_server(tmp_path, 0.5, True)
    try:
        address = _node_address(metrics, offset, proc.pid, 60)
    finally:
        proc.kill()
        proc.wait()
    assert address == "tcp://127.0.0.1:4242"


def test_node_address_of_a_server_that_dies_or_hangs(tmp_path: Path) -> None:
    proc = _fake_server(tmp_path, 0.0, False)
    try:
        with pytest.raises(PSError, match="exited before it listened"):
            _node_address(tmp_path / "metrics.jsonl", 0, proc.pid, 60)
    finally:
        proc.wait()
    proc = _fake_server(tmp_path, 30.0, False)
    try:
        with pytest.raises(NetworkTimeout, match=r"did not listen within 0\.5 s"):
            _node_address(tmp_path / "metrics.jsonl", 0, proc.pid, 0.5)
    finally:
        proc.kill()
        proc.wait()


# --- parameter shards ------------------------------------------------------------------------


def test_shards_spread_over_components() -> None:
    _, groups = parse_het("a:workers=2;b:workers=2;c:workers=1")
    assert [g.shards for g in spread_shards(groups, 4)] == [2, 1, 1]
    assert [g.shards for g in spread_shards(groups, 0)] == [0, 0, 0]
    _, named = parse_het("a:workers=2,shards=2;b:workers=2")
    assert [g.shards for g in spread_shards(named, 0)] == [2, 0]
    assert [g.shards for g in spread_shards(named, 2)] == [2, 0]
    with pytest.raises(ConfigError, match="components hold 2"):
        spread_shards(named, 3)
    with pytest.raises(ConfigError, match="shards must be between 0 and its 2 CPUs"):
        parse_het("a:workers=2,shards=3")


def test_one_shard_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="at least 2"):
        _job(tmp_path, groups=(Group("workers", (1.0, 1.0), shards=1),))


def test_script_with_shards(tmp_path: Path) -> None:
    plain = _job(tmp_path, groups=(Group("workers", (1.0, 2.0), nodes=2, shards=2),))
    text = render(plain, "c", "s")
    assert _bash_syntax_ok(text, tmp_path)
    assert "--shards 2\n" in text
    assert "srun --overlap --ntasks=2 --cpus-per-task=1 --distribution=cyclic" in text
    assert "launch.slurm.node shard --name-prefix shard --" in text
    assert 'SECRET_ARGS=(--shard-secret-file "$SHARD_SECRET")' in text
    assert '--secret-file "$SHARD_SECRET" --connect-timeout' in text
    _, groups = parse_het("a:workers=2;b:workers=2,shards=2")
    het = render(_job(tmp_path, groups=groups, het=True), "c", "s")
    assert _bash_syntax_ok(het, tmp_path)
    assert "srun --het-group=1 --overlap --ntasks=2" in het
    assert "--name-prefix b-shard" in het and het.count("launch.slurm.node shard") == 1
    none = render(_job(tmp_path), "c", "s")
    assert "--shards 2" not in none and "launch.slurm.node shard" not in none
    assert "SHARD_PIDS=()" in none  # the end of the script waits on an empty list
    assert "SECRET_ARGS=()" in none and "--shard-secret-file" not in none


def test_the_job_writes_a_fresh_private_shard_secret(tmp_path: Path) -> None:
    """The script's own lines: 32 bytes only the user can read, never through a file or
    link already at that name."""
    job = _job(tmp_path, groups=(Group("workers", (1.0, 2.0), nodes=2, shards=2),))
    text = render(job, "c", "s")
    begin = text.index("SHARD_SECRET=$RUN_DIR")
    block = text[begin : text.index("\n", text.index("SECRET_ARGS=", begin))]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {"RUN_DIR": str(run_dir), "SLURM_JOB_ID": "7", "ATTEMPT": "0", "PATH": "/usr/bin:/bin"}
    script = block + '\necho "${SECRET_ARGS[@]}"'
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)
    secret = run_dir / "shard-7.0.secret"
    assert done.returncode == 0 and done.stdout.split() == ["--shard-secret-file", str(secret)]
    assert secret.stat().st_size == 32 and secret.stat().st_mode & 0o077 == 0
    planted = run_dir / "shard-7.1.secret"
    planted.symlink_to(tmp_path / "elsewhere")
    again = subprocess.run(
        ["bash", "-c", script], env={**env, "ATTEMPT": "1"}, text=True, capture_output=True
    )
    assert again.returncode == 1 and "cannot write the shard secret" in again.stderr
    assert not (tmp_path / "elsewhere").exists()


def test_shard_command() -> None:
    env = {"SLURM_PROCID": "1", "SLURMD_NODENAME": "gpu07"}
    argv = shard_command("shard", env, ("--coordinator", "tcp://10.1.1.1:5000"), "10.1.1.7")
    assert argv[:4] == [sys.executable, "-m", "pserver.cli", "shard"]
    assert argv[4:] == [
        "--bind",
        "tcp://10.1.1.7:0",
        "--name",
        "shard1-gpu07",
        "--coordinator",
        "tcp://10.1.1.1:5000",
    ]
    with pytest.raises(ConfigError, match="srun step"):
        shard_command("shard", {"SLURM_PROCID": "0"}, ())


def test_a_run_stopped_by_a_signal_goes_on_when_resumed() -> None:
    from pserver.runstate import RunState

    meta: dict[str, object] = {"train_start": 1.0, "time_to_target": None, "epochs_done": 2}
    meta["evals"] = []
    stopped, ended = RunState(), RunState()
    stopped.load_meta({**meta, "finish_reason": "stopped"})  # scancel, a time limit
    ended.load_meta({**meta, "finish_reason": "epochs"})
    assert not stopped.finished and stopped.epochs_done == 2
    assert ended.finished


def test_the_job_drops_option_variables_of_the_submitting_shell(tmp_path: Path) -> None:
    """sbatch exports the submitter's environment: ``PSERVER_START_OVERWRITE=1`` set there
    must not make the job's server delete an earlier run."""
    text = render(_job(tmp_path), "pslaunch slurm ...", "/x/job.sbatch")
    block = re.search(r"^for NAME in \$\(compgen -e\).*?^done$", text, re.M | re.S)
    assert block is not None, text
    env = {"PATH": "/usr/bin:/bin", "PSERVER_START_OVERWRITE": "1", "WORKER_JOIN_NAME": "w"}
    env |= {"PSLAUNCH_LOCAL_WORKERS": "3", "KEEP_ME": "1"}
    done = subprocess.run(
        ["bash", "-c", f"{block.group(0)}\nenv"], env=env, capture_output=True, text=True
    )
    names = {line.split("=", 1)[0] for line in done.stdout.splitlines()}
    assert "KEEP_ME" in names and not {n for n in names if n.startswith(("PSERVER_", "WORKER_"))}
    assert "PSLAUNCH_LOCAL_WORKERS" not in names


def test_node_ddp_runs_the_rendezvous_with_the_same_options(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[list[str]] = []

    def execv(path: str, argv: list[str]) -> None:  # replacing pytest's own process is no test
        calls.append([path, *argv])
        raise SystemExit(0)

    monkeypatch.setattr("launch.slurm.node.os.execv", execv)
    result = CliRunner().invoke(node_main, ["ddp", "--config", "job/ddp_config.json", "--gpu"])
    assert result.exit_code == 0, result.output
    rank = ["launch.slurm.rendezvous", "--config", "job/ddp_config.json", "--gpu"]
    assert calls == [[sys.executable, sys.executable, "-m", *rank]]
