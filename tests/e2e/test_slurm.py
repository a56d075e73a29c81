"""Real Slurm jobs on the project's testbed: plain, by hand, heterogeneous, scancel, requeue."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import NetworkTimeout
from launch.settings import TrainSettings
from launch.slurm.config import SlurmRuns
from launch.slurm.groups import Group
from launch.slurm.script import resources
from launch.slurm.submit import run_job, wait_job
from tests.support.slurm_jobs import (
    JOB_TIMEOUT_S,
    ROOT,
    events,
    job_id_of,
    jobs_shown_and_cancelled,
    logs,
    pslaunch,
    summary,
    wait_for_event,
    wait_for_state,
)

pytestmark = [pytest.mark.slurm, pytest.mark.exclusive, pytest.mark.usefixtures("slurm_testbed")]

TRAIN_COUNT = 964  # 10 % of Jasper Ridge's labelled pixels (the jasper_h5 fixture)
TRAIN = ("--lr", "0.05", "--lr-schedule", "cosine")


def _job_args(dataset: Path, run_dir: Path, epochs: int, *more: str) -> list[str]:
    return [
        "slurm",
        "--dataset",
        str(dataset),
        "--model",
        "hsi-cnn",
        "--epochs",
        str(epochs),
        *TRAIN,
        "--run-dir",
        str(run_dir),
        "--time",
        "10:00",
        "--signal-before",
        "60",
        "--worker-opt=--log-every=1000",
        *more,
    ]


def _check_trained(run_dir: Path, epochs: int, slowdowns: set[float]) -> dict:
    result = summary(run_dir)
    assert result["final"]["oa"] >= 0.85, result["final"]
    assert result["epochs"] == epochs
    assert result["samples_seen"] == epochs * TRAIN_COUNT
    assert {w["slowdown"] for w in result["workers"]} == slowdowns
    return result


def test_pslaunch_slurm_wait_trains_jasper_ridge(jasper_h5: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "plain"
    jobs: list[str] = []
    with jobs_shown_and_cancelled(run_dir, jobs):
        done = pslaunch(*_job_args(jasper_h5, run_dir, 8, "--slowdowns", "1,2", "--wait"))
        if "submitted job" in done.stdout:
            jobs.append(job_id_of(done.stdout))
        assert done.returncode == 0, done.stdout + done.stderr
        assert "ended: COMPLETED, exit code 0" in done.stdout
        assert "w0-x1" in done.stdout and "w1-x2" in done.stdout  # the printed summary
        result = _check_trained(run_dir, 8, {1.0, 2.0})
        by_slowdown = {w["slowdown"]: w for w in result["workers"]}
        assert by_slowdown[1.0]["samples"] > 1.5 * by_slowdown[2.0]["samples"]
        # The server ran in the job script; its address is the one in the start event.
        start = [e for e in events(run_dir) if e["event"] == "start"]
        assert len(start) == 1
        assert f"listens on {start[0]['address']}" in logs(run_dir)


def test_job_sbatch_submitted_by_hand_with_two_shards(jasper_h5: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "by-hand"
    args = _job_args(jasper_h5, run_dir, 10, "--mode", "async", "--slowdowns", "1,2")
    done = pslaunch(*args, "--nodes", "2", "--shards", "2")
    assert done.returncode == 0, done.stderr
    script = run_dir / "job.sbatch"
    text = script.read_text()
    assert text.startswith("#!/bin/bash\n")
    assert "#SBATCH --signal=B:TERM@60" in text and "#SBATCH --requeue" in text
    assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks=2" in text
    comments = [line for line in text.splitlines() if line.startswith("# ")]
    assert len(comments) >= 15  # explained, not just commands
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    jobs: list[str] = []
    with jobs_shown_and_cancelled(run_dir, jobs):
        # From another directory, as a user would after editing it.
        waited = subprocess.run(
            ["sbatch", "--wait", str(script)],
            capture_output=True,
            text=True,
            timeout=JOB_TIMEOUT_S,
            cwd="/",
        )
        jobs.append(waited.stdout.split()[-1] if waited.stdout.strip() else "")
        assert waited.returncode == 0, waited.stdout + waited.stderr
        result = _check_trained(run_dir, 10, {1.0, 2.0})
        assert result["mode"] == "async" and result["staleness"]["max"] >= 1
        assert result["details"]["shards"] == 2
        # One shard on each of the job's two nodes (shard names end in their node's name).
        shards = [e for e in events(run_dir) if e["event"] == "shard"]
        nodes = {e["host"].rsplit("-", 1)[1] for e in shards}
        assert len(shards) == 2 and len(nodes) == 2, shards


def test_heterogeneous_job_with_two_worker_components(jasper_h5: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "het"
    spec = "server:cpus=1;fast:slowdown=1;slow:slowdown=2,cpus=1"
    jobs: list[str] = []
    with jobs_shown_and_cancelled(run_dir, jobs):
        done = pslaunch(*_job_args(jasper_h5, run_dir, 8, "--het", spec, "--wait"))
        if "submitted job" in done.stdout:
            jobs.append(job_id_of(done.stdout))
        assert done.returncode == 0, done.stdout + done.stderr
        text = (run_dir / "job.sbatch").read_text()
        assert text.count("#SBATCH hetjob") == 2
        assert "--het-group=1" in text and "--het-group=2" in text
        result = _check_trained(run_dir, 8, {1.0, 2.0})
        assert sorted(w["name"] for w in result["workers"]) == ["fast-w0-x1", "slow-w0-x2"]
        # Slurm placed the three components on three different nodes.
        out = next(run_dir.glob("slurm-*.out")).read_text()
        nodes = out.split("job: components on ", 1)[1].split()[0].split(",")
        assert len(set(nodes)) == 3, out


def test_requeue_on_term_then_scancel_then_resume_in_a_new_job(
    jasper_h5: Path, tmp_path: Path
) -> None:
    """TERM to the job script alone (what --signal=B:TERM does before the time limit)
    requeues the job, which resumes; scancel then ends it for good with a checkpoint and
    summary.json; 'pslaunch slurm --resume' in a new job finishes the run."""
    run_dir = tmp_path / "interrupted"
    epochs = 10
    args = _job_args(jasper_h5, run_dir, epochs, "--slowdowns", "1,2")
    jobs: list[str] = []
    with jobs_shown_and_cancelled(run_dir, jobs):
        done = pslaunch(*args, "--submit")
        assert done.returncode == 0, done.stdout + done.stderr
        job = job_id_of(done.stdout)
        jobs.append(job)

        wait_for_event(run_dir, "epoch")  # training is under way
        subprocess.run(["scancel", "--batch", "--signal=TERM", job], check=True, timeout=30)
        wait_for_state(job, "Restarts=1")
        assert "requeueing" in logs(run_dir)
        wait_for_event(run_dir, "resume")  # after the testbed's 20 s credential expiry
        first = summary(run_dir)  # written by attempt 0 when it stopped
        assert 1 <= first["epochs"] < epochs

        wait_for_event(run_dir, "epoch", after="resume")
        subprocess.run(["scancel", job], check=True, timeout=30)
        end = wait_job(job, JOB_TIMEOUT_S)
        assert end.state == "CANCELLED"
        assert logs(run_dir).count("requeueing") == 1  # scancel ends the job for good
        stopped = summary(run_dir)
        assert first["steps"] < stopped["steps"] and stopped["epochs"] < epochs
        checkpoints = list((run_dir / "checkpoints").glob("ckpt-*.npz"))
        assert f"ckpt-{stopped['steps']:010d}.npz" in {p.name for p in checkpoints}
        assert sorted(p.name for p in run_dir.glob("server-*.log")) == [
            f"server-{job}.0.log",
            f"server-{job}.1.log",
        ]

        again = pslaunch(*args, "--resume", "--wait")
        if "submitted job" in again.stdout:
            jobs.append(job_id_of(again.stdout))
        assert again.returncode == 0, again.stdout + again.stderr
        resumed = [e for e in events(run_dir) if e["event"] == "resume"]
        assert [e["version"] for e in resumed][-1] == stopped["steps"]
        starts = [e for e in events(run_dir) if e["event"] == "start"]
        assert len(starts) == 3
        _check_trained(run_dir, epochs, {1.0, 2.0})


def test_workers_pick_their_gpu_as_slurm_hands_them_out() -> None:
    """The testbed's last node has two stand-in GPUs; Slurm sets CUDA_VISIBLE_DEVICES."""

    def devices(group: Group) -> list[str]:
        done = subprocess.run(
            [
                "srun",
                "--nodelist=sl3",
                *resources(group),
                sys.executable,
                "-m",
                "launch.slurm.node",
                "device",
                "--gpu" if group.gpus else "--no-gpu",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env={k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"},
        )
        assert done.returncode == 0, done.stderr
        return sorted(done.stdout.split("\n")[:-1])

    # One GPU each (--gpus-per-task): each task sees only its own, as cuda:0.
    own = Group("g", (1.0, 1.0), gpus_per_worker=1, nodes=1)
    assert devices(own) == ["0 cuda:0", "1 cuda:0"]
    # Sharing the node's GPUs (--gpus-per-node): one per local task.
    shared = Group("g", (1.0, 1.0), gpus_per_node=2, nodes=1)
    assert devices(shared) == ["0 cuda:0", "1 cuda:1"]
    assert devices(Group("g", (1.0,))) == ["0 cpu"]


def test_pslaunch_slurm_ddp_runs_ranks_on_two_nodes(jasper_h5: Path, tmp_path: Path) -> None:
    """DDP ranks as srun tasks on two nodes; MASTER_ADDR names the rendezvous host."""
    run_dir = tmp_path / "ddp"
    args = ["slurm", "--mode", "ddp", "--dataset", str(jasper_h5), "--model", "hsi-cnn"]
    args += ["--slowdowns", "1,2", "--nodes", "2", "--epochs", "3", *TRAIN]
    args += ["--time", "10:00", "--run-dir", str(run_dir), "--wait"]
    jobs: list[str] = []
    with jobs_shown_and_cancelled(run_dir, jobs):
        done = pslaunch(*args, env={"MASTER_ADDR": "localhost"})
        if "submitted job" in done.stdout:
            jobs.append(job_id_of(done.stdout))
        assert done.returncode == 0, done.stdout + done.stderr
        assert "ended: COMPLETED, exit code 0" in done.stdout
        assert "#SBATCH --no-requeue" in (run_dir / "job.sbatch").read_text()
        result = summary(run_dir)
        assert result["mode"] == "ddp" and result["epochs"] == 3
        assert result["samples_seen"] == 3 * TRAIN_COUNT
        assert result["final"]["oa"] >= 0.85, result["final"]
        ranks = {w["name"]: w["samples"] for w in result["workers"]}
        assert ranks == {"r0-x1": 3 * TRAIN_COUNT // 2, "r1-x2": 3 * TRAIN_COUNT // 2}
        # Two nodes; task 0 published the rendezvous at MASTER_ADDR and a port it picked.
        out = next(run_dir.glob("slurm-*.out")).read_text()
        nodelist = out.split("DDP ranks on ", 1)[1].split(",", 1)[0].split()[0]
        hosts = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30
        ).stdout.split()
        assert len(hosts) == 2, out
        published = (run_dir / f"rendezvous-{jobs[0]}.0").read_text().strip()
        assert re.fullmatch(r"localhost:\d+", published), published


def test_compare_launcher_slurm_writes_the_report(jasper_h5: Path, tmp_path: Path) -> None:
    """Each mode runs as its own Slurm job, in the given order; the usual report follows."""
    out = tmp_path / "cmp"
    args = ["compare", "--launcher", "slurm", "--dataset", str(jasper_h5), "--model", "hsi-cnn"]
    args += ["--modes", "weighted-sync,ddp", "--slowdowns", "1,2", "--epochs", "4", *TRAIN]
    args += ["--repeats", "1", "--time", "10:00", "--wait-timeout", "240", "--no-progress"]
    jobs: list[str] = []
    with jobs_shown_and_cancelled(out, jobs):
        try:
            done = pslaunch(*args, "--out", str(out), timeout=2 * JOB_TIMEOUT_S)
        finally:
            jobs += [p.stem.split("-", 1)[1] for p in out.glob("runs/*/slurm-*.out")]
        assert done.returncode == 0, done.stdout + done.stderr
        data = json.loads((out / "compare.json").read_text())
        assert data["settings"]["launcher"] == "slurm"
        runs = data["runs"]
        assert [r["mode"] for r in runs] == ["weighted-sync", "ddp"]
        job_ids = []
        for run, kind in zip(runs, ("pserver.cli start", "launch.slurm.rendezvous"), strict=True):
            assert "error" not in run, run
            result = run["summary"]
            assert result["mode"] == run["mode"] and result["epochs"] == 4
            assert result["samples_seen"] == 4 * TRAIN_COUNT
            assert result["final"]["oa"] >= 0.85, (run["mode"], result["final"])
            assert {w["slowdown"] for w in result["workers"]} == {1.0, 2.0}
            run_dir = Path(run["run_dir"])
            assert kind in (run_dir / "job.sbatch").read_text()
            (log,) = run_dir.glob("slurm-*.out")  # it ran as a Slurm job
            job_ids.append(int(log.stem.split("-", 1)[1]))
        assert job_ids[0] < job_ids[1]  # submitted in the compare order
        markdown = (out / "report.md").read_text()
        assert markdown.strip() in done.stdout
        rows = [line.split("|")[1].strip() for line in markdown.splitlines() if "| 1 |" in line]
        assert rows == ["weighted-sync", "ddp"]
        assert (out / "report.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_a_job_past_its_wait_timeout_is_cancelled(jasper_h5: Path, tmp_path: Path) -> None:
    """compare's wait for one job is bounded: a job still running then is cancelled."""
    job = SlurmRuns(time="10:00").job(
        dataset=jasper_h5,
        model="hsi-cnn",
        mode="ddp",
        run_dir=tmp_path / "late",
        slowdowns=(1.0,),
        train=TrainSettings(epochs=100),
        cpus=1,
    )
    jobs: list[str] = []
    with jobs_shown_and_cancelled(job.run_dir, jobs):
        with pytest.raises(NetworkTimeout, match="had not ended"):
            run_job(job, "test", 1.0, on_submit=jobs.append)
        wait_for_state(jobs[0], "JobState=CANCELLED", timeout=60)
