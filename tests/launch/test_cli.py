"""The command lines: one environment-variable scheme shown by every ``--help``, one option set
for ``pslaunch local/compare/ddp`` with the same validation, the live progress bar, and
``pslaunch local --shards K`` training with its shard processes."""

from __future__ import annotations

import io
import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from common.cli_env import walk_options
from common.training.tables import summary_tables
from launch.cli import local_cluster
from launch.cli import main as pslaunch
from launch.compare import CompareConfig
from launch.progress import RunProgress
from launch.settings import TrainSettings
from pserver.cli import main as pserver
from tests.support.paths import ROOT
from worker.cli import main as worker

PROGRAMS = {"PSERVER": pserver, "WORKER": worker, "PSLAUNCH": pslaunch}
# Options whose variable was shown by --help before the scheme was written down: the config
# field's name (seconds end in _S), kept so that scripts using them go on working.
FIELD_NAMED = {
    "connect_timeout_s",
    "shutdown_timeout_s",
    "heartbeat_s",
    "dead_after_s",
    "stage_timeout_s",
    "shard_timeout_s",
    "http_port",
    "reply_timeout_s",
    "data_timeout_s",
    "rejoin_timeout_s",
}


def _commands(root: click.Command, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if not isinstance(root, click.Group):
        return [path]
    found = []
    for name, sub in root.commands.items():
        found += _commands(sub, (*path, name))
    return found


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("prefix", sorted(PROGRAMS))
def test_every_help_names_each_option_variable_of_the_one_scheme(prefix: str) -> None:
    root = PROGRAMS[prefix]
    helps = {
        path: _flat(CliRunner().invoke(root, [*path, "--help"], prog_name="x").output)
        for path in _commands(root)
    }
    options = walk_options(root)
    assert len(options) > 10
    for path, option in options:
        assert option.envvar is None, f"{path} {option.opts}: explicit envvar {option.envvar}"
        name = "_".join(part.replace("-", "_").upper() for part in (prefix, *path, option.name))
        assert f"env var: {name}" in helps[path], (path, option.opts, name)
        flag = next(o for o in option.opts if o.startswith("--"))[2:].replace("-", "_")
        assert flag == option.name or option.name in FIELD_NAMED, (path, flag, option.name)


def test_variables_set_options_and_short_aliases_set_nothing(small_hsi: Path) -> None:
    runner = CliRunner()
    bad_mode = runner.invoke(
        pserver,
        ["start", "--dataset", str(small_hsi), "--model", "hsi-cnn"],
        env={"PSERVER_START_MODE": "bogus"},
    )
    assert bad_mode.exit_code == 2 and "Invalid value for '--mode'" in bad_mode.output
    env = {"WORKER_JOIN_SERVER": "tcp://127.0.0.1:1", "WORKER_JOIN_SLOWDOWN": "fast"}
    bad_join = runner.invoke(worker, ["join"], env=env)  # --server given by its variable
    assert bad_join.exit_code == 2 and "Invalid value for '--slowdown'" in bad_join.output
    alias = runner.invoke(worker, ["join", "--slowdown", "0.5"], env={"WORKER_SERVER": "tcp://x"})
    assert alias.exit_code == 2 and "Missing option '--server'" in alias.output
    workers = runner.invoke(
        pslaunch,
        ["local", "--dataset", str(small_hsi), "--model", "hsi-cnn", "--run-dir", "r"],
        env={"PSLAUNCH_LOCAL_WORKERS": "0"},
    )
    assert workers.exit_code == 2 and "Invalid value for '--workers'" in workers.output


SHARED = ("dataset", "model", "workers", "slowdowns", "slowdown_schedules", "devices", "epochs")
SHARED += ("max_steps", "global_batch", "optimizer", "lr", "momentum", "nesterov", "weight_decay")
SHARED += ("lr_schedule", "warmup_fraction", "seed", "target_oa", "threads", "progress")
SHARED += ("node_cpus", "server_cpus", "allow_oversubscribe", "links", "server_link")
SHARED += ("link_delay", "cluster")


def test_local_compare_and_ddp_share_one_option_set() -> None:
    params = {
        name: {p.name: p for p in pslaunch.commands[name].params}
        for name in ("local", "compare", "ddp")
    }
    for name in SHARED:
        local, compare, ddp = (params[c][name] for c in ("local", "compare", "ddp"))
        for other in (compare, ddp):
            assert local.opts == other.opts, name
            assert local.type.to_info_dict() == other.type.to_info_dict(), name
            assert local.default == other.default, name
    for name in ("staleness", "max_staleness", "server_opt"):
        info = (params[c][name].type.to_info_dict() for c in ("local", "compare"))
        assert next(info) == next(info), name
    assert params["local"]["shards"].default == 1


@pytest.mark.parametrize("command", ["local", "compare", "ddp"])
@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--workers", "0"], "Invalid value for '--workers': 0 is not in the range x>=1."),
        (["--workers", "-2"], "Invalid value for '--workers': -2 is not in the range x>=1."),
        (["--momentum", "1.5"], "--momentum must be in [0, 1), got 1.5"),
        (["--slowdowns", "1,2", "--workers", "3"], "has 2 entries for 3 workers"),
        (["--threads", "0"], "Invalid value for '--threads'"),
        (["--slowdowns", "1,1,1", "--node-cpus", "0.4,0.1"], "has 2 entries for 3 workers"),
        (["--cluster", "small-1124", "--workers", "3"], "has 4 workers, got --workers 3"),
        (["--node-cpus", "0.001"], "a CPU budget is in [0.01, 1024] cores"),
        (["--node-cpus", "fast"], "--node-cpus takes cores such as 0.4"),
    ],
)
def test_bad_values_are_refused_alike_with_a_one_line_error(
    small_hsi: Path, tmp_path: Path, command: str, args: list[str], error: str
) -> None:
    out = "--out" if command == "compare" else "--run-dir"
    base = [command, "--dataset", str(small_hsi), "--model", "hsi-cnn", out, str(tmp_path)]
    result = CliRunner().invoke(pslaunch, [*base, "--epochs", "1", *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1 and error in lines[0], result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "cluster.log").exists()


def test_a_preset_sets_the_workers_and_every_node_budget(small_hsi: Path) -> None:
    base = ["--dataset", str(small_hsi), "--model", "hsi-cnn", "--run-dir", "r", "--epochs", "1"]
    args = [*base, "--cluster", "small-1124", "--slowdowns", "2"]
    ctx = pslaunch.commands["local"].make_context("local", args)
    ctx.params.pop("progress")
    cluster, _ = local_cluster(**ctx.params)
    assert cluster.slowdowns == (2.0,) * 4  # slowdowns combine with budgets
    assert cluster.nodes is not None and cluster.nodes.name == "small-1124"
    assert [n.cpus for n in cluster.nodes.workers] == [0.4, 0.4, 0.2, 0.1]
    assert cluster.nodes.server.cpus == 0.5 and not cluster.allow_oversubscribe
    ctx = pslaunch.commands["local"].make_context(
        "local", [*base, "--node-cpus", "0.3,0.1", "--server-cpus", "0.2"]
    )
    ctx.params.pop("progress")
    cluster, _ = local_cluster(**ctx.params)
    assert cluster.slowdowns == (1.0, 1.0) and cluster.nodes is not None
    assert cluster.nodes.name is None and cluster.nodes.server.cpus == 0.2


def test_local_passes_the_training_options_to_the_server_and_workers(small_hsi: Path) -> None:
    args = ["--dataset", str(small_hsi), "--model", "hsi-cnn", "--run-dir", "r"]
    args += ["--slowdowns", "1,4", "--momentum", "0.8", "--weight-decay", "0"]
    args += ["--lr-schedule", "cosine", "--warmup-fraction", "0.1", "--max-steps", "7"]
    args += ["--threads", "2", "--staleness", "poly", "--shards", "2", "--no-progress"]
    args += ["--worker-opt=--data=copy.h5", "--worker-opt=--cache-mb=0"]
    ctx = pslaunch.commands["local"].make_context("local", args)
    ctx.params.pop("progress")
    cluster, train = local_cluster(**ctx.params)
    options = " ".join(cluster.server_options)
    for expected in ("--momentum 0.8", "--weight-decay 0.0", "--lr-schedule cosine"):
        assert expected in options
    assert "--warmup-fraction 0.1" in options and "--max-steps 7" in options
    assert "--staleness poly" in options and "--no-nesterov" in options
    assert cluster.worker_options == ("--threads", "2", "--data=copy.h5", "--cache-mb=0")
    assert cluster.slowdowns == (1.0, 4.0) and cluster.shards == 2 and train.max_steps == 7


def test_compare_passes_worker_options_to_the_parameter_server_runs_only(
    small_hsi: Path, tmp_path: Path
) -> None:
    config = CompareConfig(
        dataset=small_hsi,
        model="hsi-cnn",
        modes=("weighted-sync", "ddp"),
        slowdowns=(1.0, 2.0),
        out=tmp_path,
        train=TrainSettings(epochs=1),
        worker_options=("--data", str(small_hsi)),
    )
    cluster = config.cluster("weighted-sync", tmp_path / "ws")
    assert cluster.worker_options == ("--threads", "1", "--data", str(small_hsi))
    job = config.slurm_job("weighted-sync", tmp_path / "ws")
    assert job.worker_options == ("--data", str(small_hsi))
    assert config.slurm_job("ddp", tmp_path / "ddp").worker_options == ()


def test_the_progress_bar_counts_samples_and_shows_epoch_version_and_oa() -> None:
    sink = io.StringIO()
    bar = RunProgress(epochs=2, max_steps=None, file=sink)
    bar.feed({"event": "start", "train": 100})
    assert bar.bar.total == 200
    bar.feed(
        {"event": "round", "epoch": 1, "version": 1, "workers": [{"batch": 40}, {"batch": 24}]}
    )
    bar.feed({"event": "eval", "oa": 0.51234, "epoch": 1})
    bar.feed({"event": "push", "epoch": 2, "version": 2, "batch": 30})
    bar.feed({"event": "join", "worker": "w0"})
    assert bar.bar.n == 94 and bar.samples == 94 and bar.steps == 2
    assert bar.status() == "epoch 2, version 2, OA 0.512"
    bar.close()
    assert "94/200" in sink.getvalue() and "OA 0.512" in sink.getvalue()
    steps = RunProgress(epochs=None, max_steps=10, file=io.StringIO())
    steps.feed({"event": "push", "epoch": 1, "version": 3, "batch": 30})
    assert steps.bar.total == 10 and steps.bar.n == 1
    steps.close()


def test_the_summary_tables_define_their_columns() -> None:
    summary = {
        "mode": "async",
        "epochs": 3,
        "steps": 120,
        "train_time_s": 12.345678,
        "final": {"oa": 0.912345, "aa": 0.8, "kappa": 0.85},
        "best_oa": 0.92,
        "time_to_target_s": None,
        "staleness": {"mean": 1.23456, "max": 4},
        "workers": [
            {"name": "w0-x1", "slowdown": 1.0, "speed": 1234.5678, "samples": 3000, "pushes": 80},
            {"name": "w1-x4", "slowdown": 4.0, "speed": 301.2, "samples": 750, "pushes": 40},
        ],
    }
    text = summary_tables(summary)
    assert "12.3" in text and "12.345678" not in text and "0.9123" in text
    assert "1235" in text and "80.0 %" in text  # speeds to whole samples/s; shares in percent
    for word in ("train s:", "OA:", "kappa:", "staleness:", "share:"):
        assert word in text, text


def test_workers_on_budgets_are_named_and_tabled_by_their_budget(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from launch.cli_options import warn_unbudgeted_server
    from launch.cluster.spec import parse_cluster
    from launch.local import worker_name

    assert [worker_name(0, 1.0, None), worker_name(1, 2.0, None)] == ["w0-x1", "w1-x2"]
    assert [worker_name(3, 1.0, 0.1), worker_name(1, 2.0, 0.4)] == ["w3-0.1c", "w1-0.4c-x2"]
    worker = {"slowdown": 1.0, "speed": 100.0, "samples": 10, "pushes": 2}
    summary = {
        "mode": "weighted-sync",
        "epochs": 1,
        "steps": 2,
        "train_time_s": 1.0,
        "final": None,
        "workers": [
            {**worker, "name": "w0-0.4c", "cpus": 0.4, "schedule": None},
            {**worker, "name": "w1-0.4c", "cpus": 0.4, "schedule": "0.4;off@33.3%;on@66.7%"},
        ],
    }
    header, _, first, second = summary_tables(summary).split("\n\n")[1].splitlines()[:4]
    assert "CPU budget" in header and "slowdown" not in header
    assert first.split()[:2] == ["w0-0.4c", "0.4"] and "0.4;off@33.3%;on@66.7%" in second
    summary["workers"][1]["slowdown"] = 2.0
    assert "slowdown" in summary_tables(summary)
    warn_unbudgeted_server(parse_cluster(2, node_cpus="0.4,0.1"))
    assert "--node-cpus without --server-cpus" in capsys.readouterr().err
    warn_unbudgeted_server(parse_cluster(2, node_cpus="0.4,0.1", server_cpus=0.5))
    warn_unbudgeted_server(None)
    assert capsys.readouterr().err == ""


def test_a_launch_finds_the_new_server_after_it_replaced_the_file(tmp_path: Path) -> None:
    """--overwrite removes the old metrics.jsonl: the new server's start event is at byte 0 of
    a new file, not after the old file's end."""
    from launch.procs import EventsMark, new_start_address

    metrics = tmp_path / "metrics.jsonl"
    old = {"event": "start", "t": 0, "address": "tcp://127.0.0.1:1"}
    metrics.write_text((json.dumps(old) + "\n") * 50, encoding="utf-8")
    mark = EventsMark(metrics)
    try:
        assert new_start_address(metrics, mark) is None  # only the old server's events
        with metrics.open("a", encoding="utf-8") as f:  # a resumed server appends
            f.write(json.dumps({**old, "address": "tcp://127.0.0.1:2"}) + "\n")
        assert new_start_address(metrics, mark) == "tcp://127.0.0.1:2"
        metrics.unlink()  # an overwriting server replaces the file
        metrics.write_text(json.dumps({**old, "address": "tcp://127.0.0.1:3"}) + "\n")
        assert new_start_address(metrics, mark) == "tcp://127.0.0.1:3"
    finally:
        mark.close()


def test_the_demo_refuses_an_earlier_run_without_overwrite(tmp_path: Path) -> None:
    from launch.demo import main as demo

    (tmp_path / "equal-sync").mkdir()
    (tmp_path / "equal-sync" / "summary.json").write_text("{}", encoding="utf-8")
    assert demo(["--out", str(tmp_path), "--shared", str(tmp_path / "none")]) == 2
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    demo_rule = makefile.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    assert "launch.demo" in demo_rule and "--overwrite" in demo_rule


@pytest.mark.slow
def test_data_prepare_shows_a_bar_per_pass(jasper_dir: Path, tmp_path: Path) -> None:
    from tests.support.images import make_tiff_folder

    cube, gt = (str(jasper_dir / name) for name in ("JasperRidge.mat", "JasperRidge_gt.mat"))
    hsi = CliRunner().invoke(
        pserver,
        ["data", "prepare", "hsi", "--cube", cube, "--gt", gt, "--out", str(tmp_path / "j.h5")],
    )
    assert hsi.exit_code == 0, hsi.output
    for bar in ("pass 1/2 (statistics): 100%", "pass 2/2 (patches): 100%"):
        assert bar in hsi.stderr and "100/100 [" in hsi.stderr  # Jasper Ridge is 100 x 100
    make_tiff_folder(tmp_path / "scenes", per_class=5)
    args = ["data", "prepare", "folder", str(tmp_path / "scenes"), "--out", str(tmp_path / "s.h5")]
    folder = CliRunner().invoke(pserver, args)
    images = sum(1 for p in (tmp_path / "scenes").rglob("*.tif"))
    assert folder.exit_code == 0 and "pass 2/2 (write): 100%" in folder.stderr
    assert f"{images}/{images} [" in folder.stderr
    quiet = CliRunner().invoke(pserver, [*args[:-1], str(tmp_path / "s2.h5"), "--no-progress"])
    assert quiet.exit_code == 0 and "pass 1/2" not in quiet.stderr


def test_an_evaluation_of_the_whole_test_split_can_show_its_progress(
    small_hsi: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from common.data.dataset import DatasetReader
    from launch.compare import initial_scores

    with DatasetReader(small_hsi) as reader:
        test = len(reader.test_indices)
    shown = initial_scores(small_hsi, "hsi-cnn", seed=3, batch=64, progress=True)
    err = capsys.readouterr().err
    assert "evaluating: 100%" in err and f"{test}/{test} [" in err
    assert initial_scores(small_hsi, "hsi-cnn", seed=3, batch=64) == shown
    assert "evaluating" not in capsys.readouterr().err
