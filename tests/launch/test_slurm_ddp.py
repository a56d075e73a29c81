"""DDP and comparisons under Slurm without a cluster: the DDP job script, the rank's place and
rendezvous, and how compare turns runs into jobs."""

from __future__ import annotations

import dataclasses
import datetime
import re
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from common.errors import ConfigError, NetworkTimeout
from launch.cli import main
from launch.compare import CompareConfig
from launch.ddp.launcher import DDPConfig
from launch.settings import TrainSettings
from launch.slurm.config import SlurmJob, SlurmRuns
from launch.slurm.groups import Group
from launch.slurm.rendezvous import SlurmRank, host_store, store_address, task_config
from launch.slurm.script import render

ENV = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}


@pytest.fixture()
def data(tmp_path: Path) -> Path:
    path = tmp_path / "data.h5"
    path.write_bytes(b"")  # the job scripts only need the path to exist
    return path


def _ddp_job(data: Path, **changes: object) -> SlurmJob:
    values: dict[str, object] = {
        "dataset": data,
        "model": "hsi-cnn",
        "mode": "ddp",
        "run_dir": data.parent / "run",
        "groups": (Group("workers", (1.0, 2.0), cpus=2, nodes=2),),
        "train": TrainSettings(epochs=3, lr=0.02),
        "time": "30:00",
    }
    values.update(changes)
    return SlurmJob(**values).validate()  # type: ignore[arg-type]


def test_ddp_job_script_runs_one_task_per_rank(data: Path, tmp_path: Path) -> None:
    job = _ddp_job(data)
    text = render(job, "pslaunch slurm --mode ddp ...", "/x/job.sbatch")
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    sbatch = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --no-requeue" in sbatch and "#SBATCH --time=30:00" in sbatch
    assert {"#SBATCH --ntasks=2", "#SBATCH --cpus-per-task=2", "#SBATCH --nodes=2"} <= set(sbatch)
    assert not any("--signal" in line or "hetjob" in line for line in sbatch)
    step = re.search(r"^srun .*?launch\.slurm\.rendezvous .*$", text, re.M | re.S)
    assert step is not None and "--ntasks=2" in step.group(0) and "--no-gpu" in step.group(0)
    # The embedded configuration is the job's own DDP configuration.
    body = text.split("<<'END_OF_CONFIG'\n", 1)[1].split("\nEND_OF_CONFIG\n", 1)[0]
    config = DDPConfig.from_json(body)
    assert config == job.ddp_config()
    assert config.slowdowns == (1.0, 2.0) and config.threads == 2
    assert config.train.lr == 0.02 and config.run_timeout_s == 1800


def test_ddp_job_refuses_what_only_a_server_does(data: Path) -> None:
    for changes, name in (
        ({"groups": (Group("workers", (1.0, 2.0), shards=2),)}, "--shards"),
        ({"resume": True}, "--resume"),
        ({"server_options": ("--staleness", "poly")}, "server options"),
        ({"het": True}, "--het"),
    ):
        with pytest.raises(ConfigError, match=re.escape(name)):
            _ddp_job(data, **changes)


def test_cli_writes_a_ddp_job(data: Path) -> None:
    run_dir = data.parent / "run"
    args = ["slurm", "--mode", "ddp", "--dataset", str(data), "--model", "hsi-cnn"]
    args += ["--slowdowns", "1,3", "--epochs", "2", "--run-dir", str(run_dir)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    text = (run_dir / "job.sbatch").read_text()
    assert "launch.slurm.rendezvous" in text and '"slowdowns": [\n    1.0,\n    3.0\n  ]' in text
    bad = CliRunner().invoke(main, [*args, "--shards", "2"])
    assert bad.exit_code != 0 and "--shards does not apply" in bad.output
    assert "Traceback" not in bad.output


def test_rank_place_from_slurm_variables(tmp_path: Path) -> None:
    env = {**ENV, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"}
    place = SlurmRank.from_env(env, tmp_path)
    assert (place.rank, place.world_size) == (1, 2)
    assert (place.master_host, place.master_port) == ("10.1.2.3", 29500)
    assert place.address_file == tmp_path / "rendezvous-7.0"
    assert not place.on_loopback()
    # With MASTER_PORT no file is read: every task knows the address.
    assert store_address(place, 0.01) == "10.1.2.3:29500"
    assert dataclasses.replace(place, master_host="localhost").on_loopback()
    with pytest.raises(ConfigError, match="SLURM_PROCID"):
        SlurmRank.from_env({"SLURM_NTASKS": "2", "SLURM_JOB_ID": "7"}, tmp_path)
    with pytest.raises(ConfigError, match="MASTER_PORT"):
        SlurmRank.from_env({**env, "MASTER_PORT": "70000"}, tmp_path)


def test_task_zero_hosts_the_store_and_publishes_its_port(tmp_path: Path) -> None:
    from torch.distributed import TCPStore

    task0 = SlurmRank(0, 2, "127.0.0.1", None, tmp_path / "rendezvous-7.0")
    task1 = dataclasses.replace(task0, rank=1)
    with pytest.raises(NetworkTimeout, match="rendezvous"):
        store_address(task1, 0.3)  # nothing published yet
    store, address = host_store(task0, 10.0)
    assert address == f"127.0.0.1:{store.port}" and store.port > 0
    assert store_address(task1, 5.0) == address
    host, port = address.rsplit(":", 1)
    client = TCPStore(host, int(port), None, False, timeout=datetime.timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("k") == b"v"  # the client reached task 0's store
    del client, store


def test_task_config_checks_the_step_and_names_the_gpu(data: Path) -> None:
    job = _ddp_job(data)
    job.run_dir.mkdir()
    path, config = job.run_dir / "ddp_config.json", job.ddp_config()
    path.write_text(config.to_json())
    place = SlurmRank(1, 2, "127.0.0.1", None, job.run_dir / "rendezvous-7.0")
    assert task_config(config, path, place, False, {}) == path
    env = {"CUDA_VISIBLE_DEVICES": "3", "SLURM_LOCALID": "1"}
    mine = task_config(config, path, place, True, env)
    assert mine.name == "ddp_config-1.json"
    assert DDPConfig.from_json(mine.read_text()).devices == ("cuda:0",)
    with pytest.raises(ConfigError, match="SLURM_NTASKS=3"):
        task_config(config, path, dataclasses.replace(place, world_size=3), False, {})


def _compare(data: Path, **changes: object) -> CompareConfig:
    values: dict[str, object] = {
        "dataset": data,
        "model": "hsi-cnn",
        "modes": ("async", "ddp", "single"),
        "slowdowns": (1.0, 2.0),
        "out": data.parent / "cmp",
        "train": TrainSettings(epochs=2),
        "staleness": "poly",
        "threads": 2,
        "launcher": "slurm",
        "slurm": SlurmRuns(partition="cpu", time="20:00"),
    }
    values.update(changes)
    return CompareConfig(**values).validate()  # type: ignore[arg-type]


def test_compare_runs_become_jobs_with_the_same_settings(data: Path) -> None:
    config = _compare(data)
    ps = config.slurm_job("async", data.parent / "r1")
    assert ps.mode == "async" and ps.partition == "cpu" and ps.time == "20:00"
    assert ps.groups[0].slowdowns == (1.0, 2.0) and ps.groups[0].cpus == 2
    assert ps.server_options == ("--staleness", "poly") and ps.train == config.train
    assert ps.signal_before_s == 180
    ddp = config.slurm_job("ddp", data.parent / "r2").ddp_config()
    local = config.ddp("ddp", data.parent / "r2")
    assert (ddp.slowdowns, ddp.train, ddp.threads) == (local.slowdowns, local.train, 2)
    single = config.slurm_job("single", data.parent / "r3")
    assert single.mode == "ddp" and single.groups[0].slowdowns == (1.0,)
    assert config.settings()["slurm"]["partition"] == "cpu"
    # A short limit still leaves most of it to train before the time-limit warning.
    short = _compare(data, slurm=SlurmRuns(time="3:00")).slurm_job("async", data.parent / "r4")
    assert short.signal_before_s == 60


def test_compare_on_slurm_refuses_what_jobs_cannot_do(data: Path) -> None:
    with pytest.raises(ConfigError, match="--slowdown-schedules"):
        _compare(data, slowdown_schedules=("2:4", ""))
    with pytest.raises(ConfigError, match="--devices"):
        _compare(data, devices=("cuda:0",))
    with pytest.raises(ConfigError, match="--launcher 'ssh'"):
        _compare(data, launcher="ssh")
    with pytest.raises(ConfigError, match="--time"):
        _compare(data, slurm=SlurmRuns(time="soon"))
    for modes in (("weighted-ddp",), ("weighted-sync", "ddp-kept")):
        with pytest.raises(ConfigError, match="runs plain ddp only"):
            _compare(data, modes=modes)
