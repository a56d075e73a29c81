"""Snapshots of real runs, scored after training: files, agreement, damage, first to target."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from numpy.lib import format as npy_format

from launch.local import LocalCluster, run_local
from pserver.cli import main
from pserver.snapshots import snapshots as snap

EVERY = 4


@pytest.fixture(scope="module")
def snap_run(small_hsi: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A weighted-sync run (2 workers, 3 epochs, B=16) saving every 4th version."""
    run_dir = tmp_path_factory.mktemp("snap") / "run"
    cluster = LocalCluster(
        dataset=small_hsi,
        model="hsi-cnn",
        mode="weighted-sync",
        slowdowns=(1.0, 2.0),
        run_dir=run_dir,
        server_options=(
            "--epochs",
            "3",
            "--global-batch",
            "16",
            "--snapshot-every-updates",
            str(EVERY),
        ),
        run_timeout_s=240.0,
    )
    try:
        summary = run_local(cluster)
    except Exception:
        print((run_dir / "cluster.log").read_text(encoding="utf-8"))
        raise
    return {"run_dir": run_dir, "summary": summary, "dataset": small_hsi}


def _evaluate(run_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pserver.cli", "evaluate-snapshots", str(run_dir)]
    return subprocess.run(
        [*command, "--no-progress", *extra], capture_output=True, text=True, timeout=240
    )


@pytest.fixture(scope="module")
def scored(snap_run: dict[str, Any]) -> dict[str, Any]:
    """``pserver evaluate-snapshots`` run as a process on the run."""
    done = _evaluate(snap_run["run_dir"])
    assert done.returncode == 0, done.stderr
    lines = (snap_run["run_dir"] / "snapshots.jsonl").read_text(encoding="utf-8").splitlines()
    return {"stdout": done.stdout, "rows": [json.loads(line) for line in lines]}


def test_snapshot_files_at_every_nth_version(snap_run: dict[str, Any]) -> None:
    summary = snap_run["summary"]
    steps = summary["steps"]
    directory = snap_run["run_dir"] / "snapshots"
    versions = [v for v, _ in snap.list_snapshots(directory)]
    expected = list(range(EVERY, steps + 1, EVERY))
    if steps % EVERY:
        expected.append(steps)  # the final version is always kept
    assert steps > 2 * EVERY
    assert versions == expected
    info = snap.read_run_file(directory)
    assert info["model"] == "hsi-cnn" and info["every"] == EVERY
    metas = [snap.read(p, info["state_size"])[0] for _, p in snap.list_snapshots(directory)]
    assert [m.final for m in metas] == [False] * (len(metas) - 1) + [bool(steps % EVERY)]
    samples = [m.samples for m in metas]
    times = [m.train_time_s for m in metas]
    assert samples == sorted(samples) and len(set(samples)) == len(samples)
    assert times == sorted(times) and times[0] > 0
    assert times[-1] <= summary["train_time_s"] + 1e-6
    assert samples[-1] == summary["samples_seen"]
    assert summary["details"]["snapshots"] == {
        "every": EVERY,
        "written": len(versions),
        "failed": 0,
    }


def test_last_snapshot_agrees_with_the_final_evaluation(
    snap_run: dict[str, Any], scored: dict[str, Any]
) -> None:
    rows = scored["rows"]
    last = rows[-1]
    assert last["version"] == snap_run["summary"]["steps"]
    final = snap_run["summary"]["final"]
    for key in ("oa", "aa", "kappa", "loss"):
        assert last[key] == pytest.approx(final[key], abs=1e-5), key
    # every in-run evaluation of a snapshotted version agrees too
    events = [
        json.loads(line)
        for line in (snap_run["run_dir"] / "metrics.jsonl").read_text().splitlines()
    ]
    by_version = {r["version"]: r for r in rows}
    both = [e for e in events if e["event"] == "eval" and e["version"] in by_version]
    assert both
    for event in both:
        assert by_version[event["version"]]["oa"] == pytest.approx(event["oa"], abs=1e-9)


def test_first_version_reaching_the_target(
    snap_run: dict[str, Any], scored: dict[str, Any]
) -> None:
    rows = scored["rows"]
    # a row that beats every earlier one, found here by a scan of the file
    record, best = None, -1.0
    for row in rows:
        if row["oa"] > best and best >= 0:
            record = row
        best = max(best, row["oa"])
    assert record is not None, rows
    target = record["oa"]
    done = _evaluate(snap_run["run_dir"], "--target-oa", repr(target))
    assert done.returncode == 0, done.stderr
    expected = next(r for r in rows if r["oa"] >= target)
    assert expected["version"] == record["version"] or expected["oa"] == target
    assert f"first version reaching OA {target:g}: {expected['version']} " in done.stdout
    assert f"at training time {expected['train_time_s']:.2f} s" in done.stdout
    unreachable = _evaluate(snap_run["run_dir"], "--target-oa", "1.0")
    if max(r["oa"] for r in rows) < 1.0:
        assert "no snapshot reached OA 1" in unreachable.stdout


def _damage_copy(snap_run: dict[str, Any], tmp_path: Path) -> tuple[Path, Path, int]:
    run_dir = tmp_path / "run"
    shutil.copytree(snap_run["run_dir"] / "snapshots", run_dir / "snapshots")
    info = snap.read_run_file(run_dir / "snapshots")
    victim = snap.list_snapshots(run_dir / "snapshots")[1][1]
    return run_dir, victim, info["state_size"]


def _npz(path: Path, **arrays: Any) -> None:
    with path.open("wb") as handle:
        np.savez(handle, **arrays)


def _meta(**fields: Any) -> np.ndarray:
    document = {"format": 1, "kind": snap.KIND, "version": 8, "epoch": 1, "samples": 128}
    document.update({"train_time_s": 1.0, **fields})
    return np.frombuffer(json.dumps(document).encode(), dtype=np.uint8)


def _hostile(kind: str, path: Path, size: int) -> None:
    state = np.zeros(size, dtype=np.float32)
    if kind == "truncated":
        path.write_bytes(path.read_bytes()[:1000])
    elif kind == "garbage":
        path.write_bytes(np.random.default_rng(0).bytes(5000))
    elif kind == "pickled":
        _npz(path, state=np.array([{"a": 1}], dtype=object), meta=_meta())
    elif kind == "wrong-size":
        _npz(path, state=state[:-1], meta=_meta())
    elif kind == "float64":
        _npz(path, state=state.astype(np.float64)[: size // 2], meta=_meta())
    elif kind == "nan":
        state[3] = np.nan
        _npz(path, state=state, meta=_meta())
    elif kind == "negative-time":
        _npz(path, state=state, meta=_meta(train_time_s=-1))
    elif kind == "bad-json":
        _npz(path, state=state, meta=np.frombuffer(b"{not json", dtype=np.uint8))
    elif kind == "other-version":
        _npz(path, state=state, meta=_meta(version=9))
    elif kind == "extra-member":
        _npz(path, state=state, meta=_meta(), extra=state)
    elif kind == "bomb":  # compresses to little, would expand to 400 MB
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
            archive.writestr("meta.npy", b"")
            with archive.open("state.npy", "w", force_zip64=True) as member:
                block = bytes(1 << 20)
                for _ in range(400):
                    member.write(block)


HOSTILE = (
    "truncated",
    "garbage",
    "pickled",
    "wrong-size",
    "float64",
    "nan",
    "negative-time",
    "bad-json",
    "other-version",
    "extra-member",
    "bomb",
)


@pytest.mark.parametrize("kind", HOSTILE)
def test_damaged_snapshot_gives_a_one_line_error(
    snap_run: dict[str, Any], tmp_path: Path, kind: str
) -> None:
    run_dir, victim, size = _damage_copy(snap_run, tmp_path)
    _hostile(kind, victim, size)
    result = CliRunner().invoke(main, ["evaluate-snapshots", str(run_dir), "--no-progress"])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: snapshot {victim.name} is damaged")
    assert not (run_dir / "snapshots.jsonl").exists()


def test_damaged_snapshot_as_a_process(snap_run: dict[str, Any], tmp_path: Path) -> None:
    run_dir, victim, size = _damage_copy(snap_run, tmp_path)
    _hostile("pickled", victim, size)
    done = _evaluate(run_dir)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"Error: snapshot {victim.name} is damaged: state.npy: object arrays are not read "
        "(they would unpickle)"
    ]


def _npy_member(shape: tuple[int, ...], dtype: str, data: bytes) -> bytes:
    """An ``.npy`` member whose header declares ``shape`` whatever ``data`` holds."""
    header = io.BytesIO()
    header_data = {"descr": np.dtype(dtype).str, "fortran_order": False, "shape": shape}
    npy_format.write_array_header_1_0(header, header_data)
    return header.getvalue() + data


@pytest.mark.parametrize("member", ["meta", "state"])
def test_absurd_dimensions_in_a_snapshot_are_refused_before_allocating(
    snap_run: dict[str, Any], tmp_path: Path, member: str
) -> None:
    run_dir, victim, size = _damage_copy(snap_run, tmp_path)
    members = {"meta": _npy_member((len(_meta()),), "u1", _meta().tobytes())}
    members["state"] = _npy_member((size,), "f4", bytes(4 * size))
    members[member] = _npy_member((1 << 33, 8), "f8", b"\0" * 64)  # 512 GiB
    with zipfile.ZipFile(victim, "w") as archive:
        for name, data in members.items():
            archive.writestr(f"{name}.npy", data)
    result = CliRunner().invoke(main, ["evaluate-snapshots", str(run_dir), "--no-progress"])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and f"{member}.npy declares (8589934592, 8)" in lines[0]


@pytest.mark.parametrize("where", ["snapshot-fifo", "snapshot-dev-zero", "index-fifo"])
def test_a_fifo_or_a_device_at_a_snapshot_name_is_refused_at_once(
    snap_run: dict[str, Any], tmp_path: Path, where: str
) -> None:
    """Reading one would block or never end: evaluate-snapshots must refuse it, not hang."""
    run_dir, victim, _ = _damage_copy(snap_run, tmp_path)
    target = run_dir / "snapshots" / "run.json" if where == "index-fifo" else victim
    target.unlink()
    if where.endswith("fifo"):
        os.mkfifo(target)
    else:
        target.symlink_to("/dev/zero")
    command = [sys.executable, "-m", "pserver.cli", "evaluate-snapshots", str(run_dir)]
    done = subprocess.run([*command, "--no-progress"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith("is not a regular file"), done.stderr


def test_missing_index_and_other_dataset_are_refused(
    snap_run: dict[str, Any], tmp_path: Path
) -> None:
    run_dir, _, _ = _damage_copy(snap_run, tmp_path)
    other = tmp_path / "other.h5"
    from common.data.convert.synth import synth_hsi

    synth_hsi(other, bands=16, size=24, classes=4, train_fraction=0.3, seed=2)
    result = CliRunner().invoke(
        main, ["evaluate-snapshots", str(run_dir), "--dataset", str(other), "--no-progress"]
    )
    assert result.exit_code == 1 and "fingerprint differs" in result.output
    (run_dir / "snapshots" / "run.json").unlink()
    result = CliRunner().invoke(main, ["evaluate-snapshots", str(run_dir)])
    assert result.exit_code == 1 and "--snapshot-every-updates" in result.output


def test_compare_takes_time_to_target_from_snapshots(tmp_path: Path) -> None:
    from common.data.convert.synth import synth_hsi
    from launch.cli import main as pslaunch

    data = tmp_path / "hsi.h5"
    synth_hsi(data, samples=400, bands=16, size=32, classes=4, train_fraction=0.3, seed=4)
    out = tmp_path / "cmp"
    args = ["compare", "--dataset", str(data), "--model", "hsi-cnn", "--modes", "async,ddp"]
    args += ["--slowdowns", "1,2", "--epochs", "3", "--global-batch", "32", "--repeats", "1"]
    args += ["--target-oa", "0.6", "--snapshot-every", "2", "--no-progress", "--out", str(out)]
    result = CliRunner().invoke(pslaunch, args)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "compare.json").read_text())
    runs = {r["mode"]: r for r in report["runs"]}
    # 3 epochs of 120 samples in steps of 32 (the last of each epoch 24): 12 DDP steps
    assert runs["ddp"]["summary"]["steps"] == 12
    expected_every = {"async": 4, "ddp": 2}  # async: 2 x 2 workers pushes
    for mode, run in runs.items():
        assert run["time_to_target_source"] == "snapshots", run.get("snapshot_error")
        assert run["snapshot_every"] == expected_every[mode]
        rows = [
            json.loads(line)
            for line in (Path(run["run_dir"]) / "snapshots.jsonl").read_text().splitlines()
        ]
        versions = [r["version"] for r in rows]
        steps = run["summary"]["steps"]
        every = expected_every[mode]
        assert versions[: steps // every] == list(range(every, steps + 1, every)), versions
        assert versions[-1] == steps
        final = run["summary"]["final"]
        assert rows[-1]["oa"] == pytest.approx(final["oa"], abs=1e-5)
        first = next((r for r in rows if r["oa"] >= 0.6), None)
        if first is None:
            assert run["time_to_target_s"] is None
        else:
            assert run["time_to_target_s"] == first["train_time_s"]
            assert run["time_to_target_version"] == first["version"]
        assert [p["version"] for p in run["snapshot_curve"]] == versions
    markdown = (out / "report.md").read_text()
    assert "first snapshot with OA at or above the target" in markdown
    assert "async: snapshots every 4 updates; ddp: snapshots every 2 updates" in markdown


def test_sharded_async_run_snapshots_the_gathered_state(small_hsi: Path, tmp_path: Path) -> None:
    from tests.support.cluster import start_server, start_shard, start_worker

    run_dir = tmp_path / "run"
    options = ("--shards", "2", "--workers", "2", "--mode", "async", "--epochs", "2")
    server, address = start_server(
        small_hsi, run_dir, *options, "--global-batch", "16", "--snapshot-every-updates", "3"
    )
    procs = [start_shard(address, f"shard{i}") for i in range(2)]
    procs += [start_worker(address, f"w{i}", 1.0 + i) for i in range(2)]
    try:
        assert server.wait() == 0, server.output()
        assert all(p.wait(timeout=60) == 0 for p in procs)
    finally:
        for proc in (server, *procs):
            proc.kill()
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = summary["steps"]
    versions = [v for v, _ in snap.list_snapshots(run_dir / "snapshots")]
    assert versions[: steps // 3] == list(range(3, steps + 1, 3)) and versions[-1] == steps
    done = _evaluate(run_dir)
    assert done.returncode == 0, done.stderr
    last = json.loads((run_dir / "snapshots.jsonl").read_text().splitlines()[-1])
    assert last["oa"] == pytest.approx(summary["final"]["oa"], abs=1e-5)
    assert last["loss"] == pytest.approx(summary["final"]["loss"], abs=1e-4)
