"""Every bench runs end to end at its smallest settings and keeps a result; the results page is
rendered from the kept results byte for byte.

The smoke runs measure nothing worth reading (a few rounds, one repeat, tiny data): they keep
the benches from rotting as the code under them changes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.cli import BENCHES
from bench.harness.record import (
    RESULTS_DIR,
    Result,
    figures_in,
    read_results,
    recording,
    results_by_name,
)
from bench.report import (
    README,
    README_END,
    README_START,
    RESULTS_DOC,
    own_ground_table,
    readme_table,
    render,
    with_readme_table,
)
from common.errors import ConfigError
from launch.cluster.budgets import require_hierarchy
from tests.support.paths import ROOT
from tests.support.requirements import missing

SMOKE_TIMEOUT_S = 600.0

# A bench's smallest run, and what it needs beyond the project, comma-separated: "data" (Jasper
# Ridge), "netns" (root and iproute2), "cgroup" (root and a cpu controller), "py-spy".
SMOKE: dict[str, tuple[tuple[str, ...], str]] = {
    "chaos": (("--runs", "weighted-sync", "--epochs", "6", "--mtbf", "2", "--stop-s", "1"), ""),
    "coordinator-memory": (("--samples", "200", "--steps", "3"), ""),
    "ddp-fidelity": (("--repeats", "1", "--epochs", "1", "--slowdowns", "1,2"), "data"),
    "idle-share": (("--repeats", "1", "--epochs", "1", "--configs", "weighted-sync/model"), ""),
    "memory": (
        (
            *("--kinds", "dataset,scene", "--samples", "200", "--size", "16", "--bands", "8"),
            *("--rows", "64", "--cols", "64"),
        ),
        "",
    ),
    "multihost": (
        (
            *("--workers", "1", "--variants", "ps-k1-local", "--repeats", "1"),
            *("--steps", "3", "--warmup", "1", "--probe-mb", "1"),
            *("--model", "scene-cnn", "--size", "16", "--samples", "64"),
            *("--prefix", f"sm{os.getpid()}"),
        ),
        "netns",
    ),
    "multihost-train": (
        (
            *("--workers", "2", "--slowdowns", "1,2", "--epochs", "1", "--repeats", "1"),
            *("--model", "hsi-cnn", "--size", "10", "--patch", "5", "--global-batch", "8"),
        ),
        "netns",
    ),
    "observe": (("--events", "200", "--clients", "2", "--steps", "20", "--repeats", "1"), ""),
    "own-ground": (
        (
            *("--regimes", "small", "--epochs", "1", "--repeats", "1"),
            *("--modes", "weighted-sync,equal-sync", "--clusters", "leave-return"),
            *("--snapshot-every", "0"),
        ),
        "data,cgroup",
    ),
    "planner-speed": (("--workers", "4", "--repeats", "1"), ""),
    "round-floor": (("--requests", "40", "--compute-ms", "1"), ""),
    "round-overhead": (
        ("--rounds", "12", "--repeats", "1", "--workers", "1", "--floor-requests", "40"),
        "data",
    ),
    "round-profile": (("--seconds", "2"), "py-spy"),
    "simulate-speed": (("--workers", "16", "--shards", "2", "--rounds", "5"), ""),
    "tail-rounds": (("--seeds", "0", "--epochs", "1", "--variants", "baseline"), "data"),
    "time-to-target": (
        ("--regimes", "small", "--epochs", "1", "--modes", "weighted-sync,ddp"),
        "data",
    ),
    "wire": (("--requests", "32"), ""),
}

# Benches that write run folders take --out; the smoke run keeps them in the test's folder.
RUN_FOLDER_OPTION = {
    "chaos",
    "ddp-fidelity",
    "idle-share",
    "multihost",
    "multihost-train",
    "own-ground",
    "tail-rounds",
    "time-to-target",
}
SCRATCH_OPTION = {"memory": "--dir", "coordinator-memory": "--dir"}
# A Jasper Ridge bench prepares this file in --out unless it is there (bench.harness.jasper:
# 5x5 patches, 10 % train, random split, seed 0, as the jasper_h5 fixture's): the smoke runs
# with a run folder start from the fixture's file; round-overhead and round-profile, which
# prepare theirs in a temporary folder, still run the preparation.
BENCH_JASPER = "jasper_p5_tf10.h5"
# Smoke runs that need the machine to themselves: control groups, namespaces on a fixed subnet,
# a profiler sampling for fixed seconds, and request loops that wait a fixed time for replies.
EXCLUSIVE = {
    *("multihost", "multihost-train", "own-ground"),
    *("round-floor", "round-overhead", "round-profile", "wire"),
}


def test_every_bench_has_a_smoke_run() -> None:
    assert set(SMOKE) == set(BENCHES)


def _require(needs: str, request: pytest.FixtureRequest) -> None:
    """Skip (or fail, when the CI requires it) a bench whose needs this machine lacks."""
    for kind in needs.split(","):
        if kind == "data":
            request.getfixturevalue("jasper_dir")
        elif kind == "netns":
            request.getfixturevalue("netns_ok")
        elif kind == "cgroup":
            try:
                require_hierarchy()
            except ConfigError as exc:
                missing(request.config, "cgroup", str(exc))
        elif kind == "py-spy":
            spy = Path(sys.executable).parent / "py-spy"
            if shutil.which("py-spy") is None and not spy.exists():
                missing(request.config, "profiler", "py-spy is not installed (make setup)")


@pytest.mark.timeout(SMOKE_TIMEOUT_S + 60)
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            name,
            marks=[
                *([pytest.mark.realdata] if "data" in SMOKE[name][1] else []),
                *([pytest.mark.exclusive] if name in EXCLUSIVE else []),
            ],
        )
        for name in sorted(SMOKE)
    ],
)
def test_bench_runs_and_keeps_a_result(
    name: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    args, needs = SMOKE[name]
    _require(needs, request)
    extra: list[str] = []
    runs = tmp_path / "runs"
    if name in RUN_FOLDER_OPTION:
        extra = ["--out", str(runs)]
        if "data" in needs:
            runs.mkdir()
            (runs / BENCH_JASPER).symlink_to(request.getfixturevalue("jasper_h5"))
    elif name in SCRATCH_OPTION:
        extra = [SCRATCH_OPTION[name], str(tmp_path)]
    out = tmp_path / f"{name}.json"
    command = [sys.executable, "-m", "bench", "--out", str(out), name, *args, *extra]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S
    )
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert out.is_file(), f"{name} kept no result:\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}"
    if (runs / BENCH_JASPER).is_symlink():  # the bench took the fixture's file
        assert [p.name for p in runs.glob("jasper_*.h5")] == [BENCH_JASPER]
    result = Result.from_json(out.read_text(encoding="utf-8"))
    assert result.bench == name
    assert result.figures, f"{name} printed no name=value figure"
    assert result.command.startswith(f"python -m bench {name} ")
    assert not {"--out", "--dir"} & set(result.command.split()), result.command  # no local path
    assert result.settings and not {"out", "dir"} & set(result.settings), result.settings
    assert result.machine["cores"] >= 1 and result.machine["python"]
    if name == "own-ground":  # a node left and returned: every epoch still used each sample once
        assert result.figures["exactly_once_leave_return_small_weighted_sync"] == 1
        assert "ratio_leave_return_small_epoch_weighted_sync_vs_equal_sync" in result.figures


def test_figures_are_read_from_name_value_words() -> None:
    lines = [
        "weighted-sync median round: 9.6 ms; ratio 2.00",
        "ratio=1.57 oa_diff_ddp_vs_ws=+0.1000",
        "idle_share_weighted-sync/model=0.080 oa_weighted-sync/model=0.9050 train_s_x=1e-3",
        "train_time_ratio_speed_over_model=1.33 (per repeat: 1.20, 1.40)",
        "--rounds=5 a=b version=v2",
    ]
    assert figures_in(lines) == {
        "ratio": 1.57,
        "oa_diff_ddp_vs_ws": 0.1,
        "idle_share_weighted-sync/model": 0.08,
        "oa_weighted-sync/model": 0.905,
        "train_s_x": 0.001,
        "train_time_ratio_speed_over_model": 1.33,
    }


def test_a_bench_run_in_process_keeps_its_options_and_output() -> None:
    from bench import planner_speed

    with recording("python -m bench planner-speed") as kept:
        planner_speed.main(["--workers", "4", "--repeats", "1"])
    assert kept.settings == {"workers": "4", "repeats": 1, "follow_only": False}
    figures = figures_in(kept.lines)
    assert set(figures) >= {"planner_4_steady_ms", "reference_4_steady_ms"}
    # the change replay is deterministic: its figures are the planner's, at any size
    assert 1 <= figures["pushes_to_follow_slowdown"] <= 4
    assert 1 <= figures["pushes_to_follow_speedup"] <= 4
    assert figures["stall_plan_shift"] <= 0.1


def test_a_record_reads_back_and_a_foreign_file_is_refused(tmp_path: Path) -> None:
    result = read_results(RESULTS_DIR)[0]
    assert Result.from_json(result.to_json()) == result
    (tmp_path / "other.json").write_text(json.dumps({"bench": "x"}), encoding="utf-8")
    with pytest.raises(ValueError, match=r"other\.json"):
        read_results(tmp_path)


def test_report_renders_the_committed_results_page_and_readme_table() -> None:
    results = read_results(RESULTS_DIR)
    assert {r.bench for r in results} <= set(BENCHES)
    text = render(results)
    assert text == render(read_results(RESULTS_DIR))
    assert RESULTS_DOC.read_text(encoding="utf-8") == text, (
        "docs/results.md is not what `python -m bench report` renders from bench/results/"
    )
    readme = README.read_text(encoding="utf-8")
    table = readme_table(results_by_name(RESULTS_DIR))
    assert table in readme, "README's results table is not what `python -m bench report` renders"
    assert with_readme_table(readme, table) == readme


def test_the_page_shows_the_newest_result_of_each_command_of_any_bench() -> None:
    def kept(bench: str, args: str, date: str, value: float) -> Result:
        command = f"python -m bench {bench} {args}".strip()
        machine = {"cores": 2, "load_average": [1.5, 1.0, 0.5]}
        return Result(bench, date, command, {}, machine, "", {"ratio": value}, note="pinned")

    page = render(
        [
            kept("a-new-bench", "--repeats 3", "2026-01-01T10:00:00+00:00", 1.25),
            kept("a-new-bench", "--repeats 3", "2026-01-02T10:00:00+00:00", 1.5),
            kept("a-new-bench", "", "2026-01-01", 2.0),
        ]
    )
    section = page.partition("## a-new-bench\n")[2]
    assert "`ratio=1.25`" not in section and section.count("### `python -m bench a-new-bench") == 2
    assert (
        "2026-01-02 10:00 UTC: 2 cores; load average 1.5 / 1 / 0.5; pinned\n\n`ratio=1.5`"
        in section
    )
    assert "### `python -m bench a-new-bench`\n\n2026-01-01: 2 cores" in section


def test_report_command_writes_the_same_bytes_twice(tmp_path: Path) -> None:
    doc, readme = tmp_path / "results.md", tmp_path / "README.md"
    readme.write_text(f"# Title\n\n{README_START}\nold\n{README_END}\n\nEnd.\n", encoding="utf-8")
    pages = []
    for _ in range(2):
        subprocess.run(
            [sys.executable, "-m", "bench", "report", "--doc", str(doc), "--readme", str(readme)],
            cwd=ROOT,
            check=True,
            capture_output=True,
            timeout=120,
        )
        pages.append((doc.read_bytes(), readme.read_bytes()))
    assert pages[0] == pages[1]
    assert pages[0][0] == RESULTS_DOC.read_bytes()
    assert pages[0][1].decode() == (
        f"# Title\n\n{readme_table(results_by_name(RESULTS_DIR))}\n\nEnd.\n"
    )
    check = subprocess.run(
        [sys.executable, "-m", "bench", "report", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, check.stderr


def test_documented_bench_commands_exist() -> None:
    """Every ``python -m bench NAME`` in README, CHANGELOG and docs/ names a command there is."""
    commands = {*BENCHES, "report", "rerun"}
    texts = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
    unknown = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in texts
        for name in re.findall(r"python -m bench ([a-z][\w-]*)", path.read_text(encoding="utf-8"))
        if name not in commands
    }
    assert not unknown, f"documented bench commands that do not exist: {sorted(unknown)}"
    stale = {  # the changelog may say how benches ran before
        str(path.relative_to(ROOT))
        for path in texts
        if path.name != "CHANGELOG.md"
        and re.search(r"python bench/\w+\.py", path.read_text(encoding="utf-8"))
    }
    assert not stale, f"benches are run as python -m bench NAME, not as scripts: {sorted(stale)}"


def test_rerun_runs_a_kept_command_again_into_its_own_file(tmp_path: Path) -> None:
    kept = Result(
        bench="planner-speed",
        date="2026-01-01",
        command="python -m bench planner-speed --workers 4 --repeats 1",
        settings={},
        machine={},
        git_commit="",
        figures={"planner_4_steady_ms": -1.0},
        note="other jobs running",
    )
    (tmp_path / "planner-speed-small.json").write_text(kept.to_json(), encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "bench", "rerun", "--results", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    again = Result.from_json((tmp_path / "planner-speed-small.json").read_text(encoding="utf-8"))
    assert again.command == kept.command and again.date > kept.date and not again.note
    assert again.settings == {"workers": "4", "repeats": 1, "follow_only": False}
    assert again.figures["planner_4_steady_ms"] > 0

    foreign = dataclasses.replace(kept, command="python tools/planner.py --workers 4")
    (tmp_path / "planner-speed-small.json").write_text(foreign.to_json(), encoding="utf-8")
    refused = subprocess.run(
        [sys.executable, "-m", "bench", "rerun", "--results", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0 and "not a python -m bench command" in refused.stderr


def test_the_own_ground_table_takes_each_row_from_the_result_with_the_most_seeds() -> None:
    def own(date: str, figures: dict[str, float], target: float | None = None) -> Result:
        return Result(
            bench="own-ground",
            date=f"2026-12-0{date}T10:00:00+00:00",
            command=f"python -m bench own-ground --seed {date}",
            settings={"target_oa": target},
            machine={"load_average": [0.4, 0.3, 0.2]},
            git_commit="",
            figures=figures,
        )

    three = own(
        "1",
        {
            "runs_small_weighted_sync": 3.0,
            "ratio_small_epoch_weighted_sync_vs_weighted_ddp": 2.25,
            "ratio_small_ttt_weighted_sync_vs_weighted_ddp": 1.5,
            "runs_leave_return_heavy_weighted_sync": 1.0,
            "ratio_leave_return_heavy_ttt_weighted_sync_vs_weighted_ddp": 9.0,
        },
    )
    two = own(
        "2",
        {
            "runs_leave_return_heavy_weighted_sync": 2.0,
            "ratio_leave_return_heavy_ttt_weighted_sync_vs_weighted_ddp": 7.5,
            "ratio_leave_return_heavy_epoch_weighted_sync_vs_async": 0.5,
            "final_oa_diff_leave_return_heavy_weighted_sync_vs_static": -0.004,
            "exactly_once_leave_return_heavy_weighted_sync": 0.0,
        },
        target=0.85,
    )
    kept = {k: r for k, r in results_by_name(RESULTS_DIR).items() if r.bench != "own-ground"}
    without = readme_table(kept)
    table = readme_table({**kept, "a": three, "b": two})
    assert "own ground" not in without and own_ground_table([]) == []
    assert "\n".join(own_ground_table([three, two])) in table
    lines = own_ground_table([three, two])[1:]
    assert lines[0] == (
        "| own ground | regime | seeds | vs weighted DDP: epoch / to target "
        "| vs async: epoch / to target | final OA vs static | every sample once | measured |"
    )  # columns nobody ran are left out
    assert lines[2] == (
        "| static `small-1124` | small | 3 | 2.25× / 1.50× | – / – | – | – | 2026-12-01, load 0.4 |"
    )
    assert lines[3] == (
        "| `leave-return` | heavy, target 0.85 | 2 | – / 7.50× | 0.50× / – | -0.004 | **no** "
        "| 2026-12-02, load 0.4 |"
    )  # two seeds beat one
    assert len(lines) == 4  # not run: shifting-load, static heavy
    assert "exceed the linear ideal" in table
    assert table.startswith(README_START) and table.endswith(README_END)
