"""Budget schedules of emulated nodes: parsing, refusals, presets and descriptions."""

from __future__ import annotations

import pytest

from common.errors import ConfigError
from launch.cluster.schedule import (
    Change,
    ScheduleFollower,
    ScheduleRunner,
    parse_schedule,
    schedule_text,
)
from launch.cluster.spec import PRESETS, ClusterSpec, parse_cluster


def test_a_plain_budget_has_no_changes() -> None:
    assert parse_schedule("0.4") == (0.4, ())
    assert parse_schedule("0.4@0") == (0.4, ())


def test_budget_steps_by_share_and_by_seconds() -> None:
    start, changes = parse_schedule("0.4;0.05@33.3%;0.4@66.7%")
    assert start == 0.4
    assert changes == (Change(0.333, True, 0.05), Change(0.667, True, 0.4))
    _, timed = parse_schedule("0.2;0.1@12s")
    assert timed == (Change(12.0, False, 0.1),)
    assert timed[0].reached(share=0.9, seconds=12.0)
    assert not timed[0].reached(share=0.9, seconds=11.9)
    assert changes[0].reached(share=0.333, seconds=0.0)


def test_off_and_on_return_with_the_budget_the_node_left_with() -> None:
    start, changes = parse_schedule("0.4;0.2@10%;off@33%;on@66%")
    assert [c.action for c in changes] == ["budget", "off", "on"]
    assert changes[1].cores is None and changes[2].cores == 0.2
    assert schedule_text(start, changes) == "0.4;0.2@10%;off@33%;on@66%"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("fast", "takes cores"),
        ("0.4;0.1", "VALUE@N%"),
        ("0.4;0.1@50%;0.2@40%", "must increase"),
        ("0.4;0.1@100%", "inside the run"),
        ("0.4;0.1@10%;0.2@5s", "mixes"),
        ("0.4;on@10%", "without 'off'"),
        ("0.4;off@10%;off@20%", "already off"),
        ("0.4;off@10%;0.2@20%", "while the node is off"),
        ("0.4;off@10%", "come back"),
    ],
)
def test_bad_schedules_are_refused_naming_the_entry(text: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        parse_schedule(text)


def test_node_cpus_takes_a_schedule_per_node_and_checks_every_budget() -> None:
    spec = parse_cluster(2, node_cpus="0.4;0.05@50%,0.1", server_cpus=0.5)
    assert spec is not None and spec.scheduled
    assert spec.workers[0].cpus == 0.4 and spec.workers[0].peak_cpus == 0.4
    assert spec.workers[1].schedule == ()
    with pytest.raises(ConfigError, match=r"\[0.01, 1024\]"):
        parse_cluster(1, node_cpus="0.4;0.001@50%")


def test_presets_with_changes_are_small_1124_with_a_disturbed_middle_third() -> None:
    base = PRESETS["small-1124"].spec("small-1124")
    for name in ("shifting-load", "leave-return"):
        spec = PRESETS[name].spec(name)
        assert [n.cpus for n in spec.workers] == [n.cpus for n in base.workers]
        assert spec.server == base.server and spec.scheduled
        assert ClusterSpec.from_description(spec.describe()) == spec
    shifting = PRESETS["shifting-load"].spec("shifting-load").workers
    assert [c.cores for c in shifting[0].schedule] == [0.05, 0.4]
    assert [c.cores for c in shifting[3].schedule] == [0.4, 0.1]
    leaving = PRESETS["leave-return"].spec("leave-return").workers[1]
    assert [(c.action, c.at) for c in leaving.schedule] == [("off", 0.333), ("on", 0.667)]
    assert "off@33.3%" in PRESETS["leave-return"].spec("leave-return").summary_line()


def test_the_follower_reports_each_change_once_when_the_run_reaches_it() -> None:
    now = [100.0]
    spec = PRESETS["leave-return"].spec("leave-return")
    timed = parse_schedule("0.2;0.1@5s")[1]
    follower = ScheduleFollower(
        [n.schedule for n in spec.workers] + [timed], epochs=3, max_steps=None, clock=lambda: now[0]
    )
    follower.feed({"event": "start", "train": 100})
    follower.feed({"event": "round", "workers": [{"batch": 60}, {"batch": 39}]})
    assert follower.due() == []  # training has not started: no clock, no share
    follower.feed({"event": "train_start"})
    assert follower.due() == [] and follower.share == pytest.approx(0.33)
    follower.feed({"event": "push", "batch": 1})
    assert follower.due() == [(1, spec.workers[1].schedule[0])]
    assert follower.due() == []
    now[0] += 5.0
    assert follower.due() == [(4, timed[0])]
    follower.feed({"event": "resume", "samples": 50})  # a restart from a checkpoint
    assert follower.share == pytest.approx(1 / 6)
    follower.feed({"event": "round", "workers": [{"batch": 160}]})
    assert follower.due() == [(1, spec.workers[1].schedule[1])]


def test_the_follower_counts_updates_with_only_max_steps() -> None:
    follower = ScheduleFollower([parse_schedule("0.4;0.1@50%")[1]], epochs=None, max_steps=4)
    follower.feed({"event": "train_start"})
    follower.feed({"event": "round", "workers": [{"batch": 99}]})
    assert follower.due() == []
    follower.feed({"event": "push", "batch": 7})
    assert [c.cores for _, c in follower.due()] == [0.1]


def test_the_follower_has_nothing_due_once_the_run_finished() -> None:
    follower = ScheduleFollower([parse_schedule("0.4;off@50%;on@60%")[1]], epochs=1, max_steps=None)
    follower.feed({"event": "start", "train": 10})
    follower.feed({"event": "train_start"})
    follower.feed({"event": "round", "workers": [{"batch": 10}]})
    follower.feed({"event": "finish", "reason": "epochs"})
    assert follower.due() == []  # both points passed, but the run is over


class FakeNodes:
    """Records what a schedule runner asks of the nodes."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, float | None]] = []

    def set_budget(self, index: int, cores: float) -> None:
        self.calls.append(("budget", index, cores))

    def leave(self, index: int) -> None:
        self.calls.append(("leave", index, None))

    def rejoin(self, index: int) -> None:
        self.calls.append(("rejoin", index, None))


def test_the_runner_applies_each_change_once_and_records_it_on_the_runs_clock() -> None:
    now = [1000.0]  # this process's clock; the run's clock reads 1000 - 990 = 10 s here
    spec = parse_cluster(3, node_cpus="0.4;0.05@30%;0.4@60%,0.4;off@30%;on@60%,0.2")
    assert spec is not None
    follower = ScheduleFollower(
        [n.schedule for n in spec.workers], epochs=1, max_steps=None, clock=lambda: now[0]
    )
    nodes = FakeNodes()
    runner = ScheduleRunner(follower, nodes)
    runner.step([{"event": "start", "t": 9.0, "train": 100}, {"event": "train_start", "t": 9.5}])
    runner.step([{"event": "round", "t": 10.0, "workers": [{"batch": 29}]}])
    assert nodes.calls == [] and runner.applied == []
    now[0] = 1010.0
    runner.step([{"event": "round", "t": 19.0, "workers": [{"batch": 1}]}])  # read 1 s late
    assert nodes.calls == [("budget", 0, 0.05), ("leave", 1, None)]
    assert runner.applied == [
        {"node": 0, "change": "0.05@30%", "cores": 0.05, "t": 20.0, "train_t": 10.5},
        {"node": 1, "change": "off@30%", "cores": None, "t": 20.0, "train_t": 10.5},
    ]
    runner.step([{"event": "push", "t": 19.5, "batch": 29}])  # 58 %: nothing more
    assert len(nodes.calls) == 2
    now[0] = 1015.0
    runner.step([{"event": "push", "t": 24.9, "batch": 2}, {"event": "push", "batch": 40}])
    assert nodes.calls[2:] == [("budget", 0, 0.4), ("budget", 1, 0.4), ("rejoin", 1, None)]
    assert [(a["node"], a["change"], a["cores"], a["train_t"]) for a in runner.applied[2:]] == [
        (0, "0.4@60%", 0.4, 15.5),
        (1, "on@60%", 0.4, 15.5),
    ]
    runner.step([])
    assert len(runner.applied) == 4
