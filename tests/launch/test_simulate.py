"""The cluster simulator against closed forms, and its spec, run-dir and command-line inputs."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner

from common.errors import ConfigError
from common.training.flat import FlatModel
from launch.cli import main
from launch.simulate.costs import ring_allreduce_s
from launch.simulate.engine import simulate
from launch.simulate.fromrun import cluster_from_runs
from launch.simulate.spec import GBIT, MB, Cluster, Node, ServerCosts, cluster_from_spec
from launch.simulate.stagecosts import measure_stage_costs
from launch.simulate.validate import (
    MULTIHOST_LAYOUTS,
    ORDER,
    Setup,
    kept_figures,
    markdown,
    predict,
)

MODEL = 25_000_000  # parameters: 100 MB in fp32


def _cluster(nodes: list[Node], **kw: object) -> Cluster:
    args: dict[str, object] = {
        "nodes": tuple(nodes),
        "model_params": MODEL,
        "global_batch": 256,
        "samples": 256 * 20,
    }
    args.update(kw)
    return Cluster(**args)  # type: ignore[arg-type]


def _node(name: str, beta_ms: float, gbit: float = 10.0) -> Node:
    return Node(name, alpha_s=0.002, beta_s=beta_ms / 1e3, link_bytes_s=gbit * GBIT)


def test_equal_workers_weighted_sync_is_equal_sync() -> None:
    # shards on their own hosts: every worker moves the same bytes (co-located shards would
    # make their hosts faster, and weighted-sync would rightly give those more samples)
    cluster = _cluster([_node(f"gpu#{i}", 1.0) for i in range(4)], shards=2, colocated=False)
    weighted = simulate(cluster, "weighted-sync")
    equal = simulate(cluster, "equal-sync")
    assert weighted.round_s == pytest.approx(equal.round_s, rel=0.01)
    assert weighted.epoch_s == pytest.approx(equal.epoch_s, rel=0.01)
    assert weighted.members == equal.members == 4


def test_one_straggler_sets_the_equal_sync_round() -> None:
    fast = [Node(f"fast#{i}", 0.001, 0.0005, transfer_s=0.01) for i in range(3)]
    slow = Node("slow#0", 0.004, 0.004, transfer_s=0.02)
    cluster = _cluster([*fast, slow], server=ServerCosts(step_s=0.003))
    result = simulate(cluster, "equal-sync")
    slowest = 0.004 + 0.004 * 64 + 0.02 + 0.003  # B/N = 64 samples each
    assert result.round_s == pytest.approx(slowest, rel=0.01)
    fast_busy = 0.001 + 0.0005 * 64 + 0.01
    waits = 3 * (slowest - 0.003 - fast_busy)
    assert result.idle_share == pytest.approx(waits / (4 * (slowest - 0.003)), rel=0.01)
    # weighted-sync moves samples off the straggler: the round is much shorter
    assert simulate(cluster, "weighted-sync").round_s < 0.5 * result.round_s


@pytest.mark.parametrize(("n", "bucket_mb"), [(2, 1000.0), (8, 1000.0), (8, 25.0), (64, 7.0)])
def test_ddp_ring_allreduce_matches_the_closed_form(n: int, bucket_mb: float) -> None:
    nodes = [Node(f"gpu#{i}", 0.0, 1e-12, link_bytes_s=GBIT, latency_s=0.0) for i in range(n)]
    cluster = _cluster(nodes, ddp_bucket_mb=bucket_mb)
    ring = 2 * (n - 1) / n * MODEL * 4 / GBIT
    assert ring_allreduce_s(MODEL * 4, n, GBIT) == pytest.approx(ring, rel=1e-9)
    assert simulate(cluster, "ddp").round_s == pytest.approx(ring, rel=0.01)
    bf16 = dataclasses.replace(cluster, wire_dtype="bf16")
    assert simulate(bf16, "ddp").round_s == pytest.approx(ring / 2, rel=0.01)


@pytest.mark.parametrize("n", [2, 4, 16])
def test_one_colocated_shard_per_host_moves_what_the_ring_moves(n: int) -> None:
    nodes = [Node(f"gpu#{i}", 0.0, 1e-12, link_bytes_s=GBIT, latency_s=0.0) for i in range(n)]
    ring = 2 * (n - 1) / n * MODEL * 4 / GBIT
    full = simulate(_cluster(nodes, shards=n, colocated=True), "equal-sync")
    assert full.round_s == pytest.approx(ring, rel=0.01)
    one = simulate(
        _cluster(nodes, shards=1, colocated=False, server_link_bytes_s=GBIT), "equal-sync"
    )
    assert one.round_s == pytest.approx(2 * n * MODEL * 4 / GBIT, rel=0.01)  # all through one link


def test_async_staleness_and_the_bound() -> None:
    nodes = [Node(f"n#{i}", 0.001, 0.001, push_s=0.002) for i in range(4)]
    free = simulate(_cluster(nodes), "async")
    assert free.staleness is not None and free.rejected == 0
    assert free.staleness["mean"] == pytest.approx(3.0, abs=0.1)  # N - 1 others in between
    pushes = free.staleness["histogram"]  # lr factor (b/B) / (tau + 1), b = 64 for all
    lr = sum(c * 64 / 256 / (int(tau) + 1) for tau, c in pushes.items()) / sum(pushes.values())
    assert free.lr_factor_mean == pytest.approx(lr, rel=1e-9)
    bounded = simulate(_cluster(nodes, max_staleness=1), "async")
    assert bounded.rejected > 0
    assert bounded.staleness is not None and bounded.staleness["max"] <= 1
    assert bounded.epoch_s > free.epoch_s  # refused pushes are computed again


def test_weighted_sync_probes_a_worker_it_left_out() -> None:
    fast = [Node(f"fast#{i}", 0.001, 0.0005, transfer_s=0.005) for i in range(2)]
    hopeless = Node("slow#0", 0.5, 0.01, transfer_s=0.005)  # one sample outlasts the round
    result = simulate(_cluster([*fast, hopeless]), "weighted-sync", epochs=3)
    assert result.rounds == 60
    # rounds 21 and 62 (waits of 20 and 40) have the probe: 2 of 60 rounds with 3 members
    assert result.members == pytest.approx(2 + 1 / 60)


@pytest.mark.parametrize(
    ("plan", "members", "slow_batch"),
    [
        ({"planner": "compute"}, 3.0, 15),
        ({"planner": "compute", "min_local_batch": 32}, 2.0, 0),
        ({"planner": "speed"}, 3.0, 16),
    ],
)
def test_weighted_sync_plans_with_the_servers_minimum_and_planner(
    plan: dict[str, object], members: float, slow_batch: int
) -> None:
    """On compute alone the slow node's share is 15 of 256 samples (0.682 s against 0.087 s
    for 85 samples): below a minimum local batch of 32 it sits out (20 rounds: before its
    first probe); the speed planner gives it its speed's share, 16."""
    nodes = [_node("fast#0", 1.0), _node("fast#1", 1.0), _node("slow#0", 8.0)]
    result = simulate(_cluster(nodes, **plan), "weighted-sync")
    assert result.members == members
    assert result.groups["slow"]["share"] == pytest.approx(slow_batch / 256)


SPEC = {
    "model_mb": 100,
    "global_batch": 512,
    "samples": 51200,
    "shards": 2,
    "link": {"gbit": 10, "latency_ms": 0.05},
    "server": {"step_ms": 1, "step_ms_per_mb": 0.5, "decode_ms_per_mb": 0.1},
    "groups": [
        {"name": "A100", "count": 1, "per_sample_ms": 1.0, "fixed_ms": 4},
        {"name": "T4", "count": 3, "per_sample_ms": 6.0, "lognormal_sigma": 0.1},
    ],
}


def test_spec_files_in_yaml_and_json_agree(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(SPEC))
    (tmp_path / "c.json").write_text(json.dumps(SPEC))
    runner = CliRunner()
    out = [
        runner.invoke(main, ["simulate", "--spec", str(tmp_path / f"c.{ext}"), "--json"])
        for ext in ("yaml", "json")
    ]
    assert [r.exit_code for r in out] == [0, 0], [r.output for r in out]
    assert json.loads(out[0].output)["results"] == json.loads(out[1].output)["results"]
    cluster = cluster_from_spec(SPEC)
    assert [n.name for n in cluster.with_workers(8).nodes].count("A100#0") == 1
    assert sum(n.name.startswith("T4") for n in cluster.with_workers(8).nodes) == 6
    with pytest.raises(ConfigError, match=r"unknown keys \['shard'\]"):
        cluster_from_spec({**SPEC, "shard": 2})


def test_sweep_writes_the_table_json_and_plots(tmp_path: Path) -> None:
    (tmp_path / "c.json").write_text(json.dumps(SPEC))
    result = CliRunner().invoke(
        main,
        ["simulate", "--spec", str(tmp_path / "c.json"), "--mode", "weighted-sync,ddp",
         "--sweep", "workers=4,8 shards=1,2", "--out", str(tmp_path / "out")],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "out/simulate.json").read_text())
    points = [(r["point"]["workers"], r["point"].get("shards"), r["mode"]) for r in doc["results"]]
    assert points == [(4, 1, "weighted-sync"), (4, 1, "ddp"), (4, 2, "weighted-sync"),
                      (8, 1, "weighted-sync"), (8, 1, "ddp"), (8, 2, "weighted-sync")]  # fmt: skip
    assert (tmp_path / "out/epoch_vs_workers.png").stat().st_size > 1000
    assert (tmp_path / "out/epoch_vs_shards.png").stat().st_size > 1000
    bad = CliRunner().invoke(
        main, ["simulate", "--spec", str(tmp_path / "c.json"), "--sweep", "x=1"]
    )
    assert bad.exit_code != 0 and "AXIS" in bad.output


def _write_run(path: Path, mode: str, rounds: list[dict], summary: dict) -> Path:
    path.mkdir()
    start = {"event": "start", "t": 0.0, "mode": mode, "state_size": 1000, "train": 640}
    start.update({"shards": 1, "wire_dtype": "fp32"} if mode != "ddp" else {"world_size": 2})
    if mode == "weighted-sync":
        start["plan"] = {"planner": "compute", "spread": True, "min_batch": 8}
    lines = [start, *({"event": "round", "t": 1.0, **r} for r in rounds)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_from_run_dirs_calibrates_on_the_recorded_rounds(tmp_path: Path) -> None:
    rounds = []
    for i in range(40):
        b0, b1 = 40 + i % 5, 24 - i % 5  # batch sizes spread: the line has a slope
        parts = [("w0", b0, 0.002 + 0.001 * b0, 0.010), ("w1", b1, 0.004 + 0.002 * b1, 0.020)]
        rounds.append(
            {"round": i + 1, "round_s": 0.08, "step_s": 0.005,
             "workers": [{"worker": w, "batch": b, "compute_s": c, "transfer_s": t,
                          "actual_s": c + t, "predicted_s": c + t} for w, b, c, t in parts]}
        )  # fmt: skip
    ps = _write_run(tmp_path / "ps", "weighted-sync", rounds, {"workers": []})
    ddp_rounds = [
        {"round": i + 1, "round_s": 0.2 + 0.03,
         "workers": [{"worker": "r0", "batch": 32, "emulated_s": 0.1},
                     {"worker": "r1", "batch": 32, "emulated_s": 0.2}]}
        for i in range(10)
    ]  # fmt: skip
    ddp = _write_run(tmp_path / "ddp", "ddp", ddp_rounds, {"workers": []})
    cluster = cluster_from_runs([ps, ddp])
    w0, w1 = cluster.nodes
    assert (w0.alpha_s, w0.beta_s, w0.transfer_s) == pytest.approx((0.002, 0.001, 0.010))
    assert (w1.alpha_s, w1.beta_s, w1.transfer_s) == pytest.approx((0.004, 0.002, 0.020))
    assert cluster.global_batch == 64 and cluster.samples == 640
    assert cluster.ddp_allreduce_s == pytest.approx(0.03)
    assert (cluster.planner, cluster.min_local_batch) == ("compute", 8)  # as the run planned
    # equal-sync: 32 samples each; the slower worker ends the round, then the step
    equal = simulate(cluster, "equal-sync")
    assert equal.round_s == pytest.approx(0.004 + 0.002 * 32 + 0.020 + 0.005, rel=0.01)
    ddp_result = simulate(cluster, "ddp")
    assert ddp_result.round_s == pytest.approx(0.004 + 0.002 * 32 + 0.03, rel=0.01)
    # a worker the round did not time (no compute_s, transfer_s) is fitted from nothing
    untimed = [{**r, "workers": [*r["workers"], {"worker": "w2", "batch": 8, "speed": 99.0}]}
               for r in rounds]  # fmt: skip
    run = _write_run(tmp_path / "untimed", "weighted-sync", untimed, {})
    assert [n.name for n in cluster_from_runs([run]).nodes] == ["w0", "w1"]


def test_async_pushes_cost_what_a_push_costs_not_a_sync_rounds_wait(tmp_path: Path) -> None:
    # In 1 round of 5 the worker is served first (4 ms outside compute); otherwise it also
    # waits for the round's other members (30 ms).
    rounds = [
        {"round": i + 1, "round_s": 0.1, "step_s": 0.0,
         "workers": [{"worker": "w0", "batch": 64, "compute_s": 0.066,
                      "transfer_s": 0.004 if i % 5 == 0 else 0.030}]}
        for i in range(40)
    ]  # fmt: skip
    node = cluster_from_runs([_write_run(tmp_path / "ps", "weighted-sync", rounds, {})]).nodes[0]
    assert node.transfer_s == pytest.approx(0.2 * 0.004 + 0.8 * 0.030)  # sync: the mean
    assert node.push_s == pytest.approx(0.004)  # async: a push served at once
    # one worker alone: an epoch is 10 pushes of compute plus the push's own transfer
    alone = _cluster([node], model_params=1000, global_batch=64, samples=640)
    result = simulate(alone, "async", epochs=1)
    assert result.epoch_s == pytest.approx(10 * (0.066 + 0.004), rel=0.01)


def _write_async_run(path: Path, compute_s: list[float], outside_s: float, pushes: int) -> Path:
    """An async run of workers w0, w1, ... pushing 32 samples each: worker i takes
    ``compute_s[i]`` + ``outside_s`` between two of its updates (its fitted model in
    summary.json: alpha 0, beta compute/32)."""
    events = []
    for i, c in enumerate(compute_s):
        events += [
            {"worker": f"w{i}", "batch": 32, "t": 1.0 + k * (c + outside_s) + 0.001 * i}
            for k in range(pushes)
        ]
    events.sort(key=lambda e: e["t"])
    path.mkdir()
    start = {"event": "start", "t": 0.0, "mode": "async", "state_size": 1000, "train": 640}
    start.update({"shards": 1, "wire_dtype": "fp32"})
    lines = [start, *({"event": "push", "speed": 1.0, "epoch": 1, **e} for e in events)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    workers = [
        {"name": f"w{i}", "model": {"alpha_s": 0.0, "beta_s_per_sample": c / 32, "transfer_s": 0}}
        for i, c in enumerate(compute_s)
    ]
    summary = {"workers": workers, "global_batch": 64}
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_async_run_calibrates_pushes_and_the_servers_time_per_push(tmp_path: Path) -> None:
    # two workers, 0.02 and 0.05 s of compute, 0.01 s between updates outside compute; their
    # updates interleave, so the gaps between consecutive updates are 0.001 s (w1 right after
    # w0) and longer: the 10th percentile of the gaps is the server's time per push
    run = _write_async_run(tmp_path / "async", [0.02, 0.05], 0.01, 60)
    cluster = cluster_from_runs([run])
    times = sorted(json.loads(x)["t"] for x in (run / "metrics.jsonl").read_text().splitlines()[1:])
    service = float(np.quantile(np.diff(times), 0.1))
    assert cluster.server.step_s == pytest.approx(service)
    w0, w1 = cluster.nodes
    assert w0.push_s == pytest.approx(0.01 - service) and w1.push_s == pytest.approx(0.01 - service)
    assert cluster.global_batch == 64 and cluster.samples == 640
    # w0 alone: each push costs compute + push + the server's time: 20 pushes of 32 samples
    alone = dataclasses.replace(cluster, nodes=(w0,), global_batch=32)
    result = simulate(alone, "async", epochs=1)
    assert result.epoch_s == pytest.approx(20 * (0.02 + 0.01), rel=0.01)


def test_cpu_stages_on_shared_cores_add_to_the_round_in_closed_form() -> None:
    n, mb = 4, 1e6
    nodes = [Node(f"gpu#{i}", 0.0, 1e-12, link_bytes_s=GBIT, latency_s=0.0) for i in range(n)]
    costs = ServerCosts(
        step_s=0.001, step_s_per_byte=2e-3 / mb, sum_s_per_byte=1e-3 / mb,
        encode_s_per_byte=0.5e-3 / mb, decode_s_per_byte=0.1e-3 / mb,
        worker_decode_s_per_byte=0.5e-3 / mb, worker_encode_s_per_byte=0.25e-3 / mb,
    )  # fmt: skip
    plain = _cluster(nodes, shards=n, colocated=True)
    ring = simulate(plain, "equal-sync").round_s
    for cores, stretch in ((None, 1.0), (2.0, 2.0), (8.0, 1.0)):
        cluster = dataclasses.replace(plain, server=costs, shared_cores=cores)
        slice_mb = MODEL * 4 / n / mb
        update = 0.001 + (2e-3 + 1e-3 * (n - 1) + 0.5e-3) * slice_mb  # every shard at once
        worker = 0.5e-3 * MODEL * 4 / mb + 0.25e-3 * MODEL * 4 / mb  # every member at once
        # staging a piece (0.1 ms/MB) hides behind its transfer at 1 Gbit/s (8 ms/MB)
        expected = ring + stretch * (update + worker)
        assert simulate(cluster, "equal-sync").round_s == pytest.approx(expected, rel=0.01)


def test_stage_costs_are_measured_with_the_servers_code(monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[int] = []
    real_load = FlatModel.load

    def counted(flat: FlatModel, host_state: torch.Tensor) -> None:
        loads.append(host_state.numel())
        real_load(flat, host_state)

    monkeypatch.setattr(FlatModel, "load", counted)
    fp32 = measure_stage_costs(300_000, 2, 3, "fp32", repeats=3)
    assert loads == [300_000] * 3  # a worker's take-in ends with the load into its model
    bf16 = measure_stage_costs(300_000, 2, 3, "bf16", repeats=3)
    for costs in (fp32, bf16):
        assert costs.step_s_per_byte > 0 and costs.decode_s_per_byte > 0
        assert costs.worker_decode_s_per_byte > 0
    # fp32 pieces are views of the state; bf16 pieces are casts of it
    assert bf16.worker_encode_s_per_byte > 3 * fp32.worker_encode_s_per_byte
    assert bf16.encode_s_per_byte > 3 * fp32.encode_s_per_byte  # 10x to 60x measured


def test_validation_compares_each_prediction_with_the_run_next_to_it(tmp_path: Path) -> None:
    rounds = [
        {"round": i + 1, "round_s": 0.1, "step_s": 0.004,
         "workers": [{"worker": w, "batch": 32, "compute_s": c, "transfer_s": 0.01,
                      "actual_s": c + 0.01, "predicted_s": c + 0.01}
                     for w, c in (("w0", 0.02), ("w1", 0.05))]}
        for i in range(10)
    ]  # fmt: skip
    ddp_rounds = [
        {"round": i + 1, "round_s": 0.06,
         "workers": [{"worker": "r0", "batch": 32, "emulated_s": 0.02},
                     {"worker": "r1", "batch": 32, "emulated_s": 0.05}]}
        for i in range(10)
    ]  # fmt: skip
    calibration = {
        "ps": _write_run(tmp_path / "cal-ps", "weighted-sync", rounds, {}),
        "async": _write_async_run(tmp_path / "cal-async", [0.1, 0.1], 0.01, 40),
        "ddp": _write_run(tmp_path / "cal-ddp", "ddp", ddp_rounds, {}),
        "ddp_equal": _write_run(tmp_path / "cal-ddp1", "ddp", ddp_rounds, {}),
    }
    measured_s = {"weighted-sync": 0.5, "equal-sync": 0.7, "async": 0.6, "ddp": 0.6}
    runs = {}
    for mode, seconds in measured_s.items():
        runs[mode] = tmp_path / mode
        runs[mode].mkdir()
        (runs[mode] / "summary.json").write_text(json.dumps({"train_time_s": seconds, "epochs": 1}))
    # the machine slowed down between the ps calibration runs: the step took 0.014 s after
    slower = [{**r, "step_s": 0.014} for r in rounds]
    after = _write_run(tmp_path / "cal-ps-after", "weighted-sync", slower, {})
    measured = {
        "repeats": [
            {"calibration": {**{k: str(v) for k, v in calibration.items()},
                             "ps": [str(calibration["ps"]), str(after)]},
             "runs": {k: str(v) for k, v in runs.items()}}
        ]
    }  # fmt: skip
    setup = Setup(tmp_path, tmp_path / "x.h5", "hsi-cnn", "1,2", "1,1", 1, 64, 1)
    rows = predict(setup, measured)
    modes = [r["mode"] for r in rows]
    assert modes == ["weighted-sync", "equal-sync", "async", "async", "ddp", "ddp"]
    # 640 samples = 10 rounds of 0.05 + 0.01 + 0.004 s before, 0.05 + 0.01 + 0.014 s after
    equal = rows[1]
    assert equal["predicted_epoch_s"] == [pytest.approx((0.64 + 0.74) / 2)]
    assert equal["error"] == pytest.approx(0.69 / 0.7 - 1, abs=1e-4)
    assert equal["within_15pct"] is True
    assert rows[2]["calibrated_on"] == ["async"]
    assert rows[4]["predicted_epoch_s"] == [pytest.approx(0.6)]  # 10 steps of 0.06 s
    assert "| equal-sync | ps (another mode) | 0.690 / 0.700 | -1.4 % |" in markdown(rows)


def test_weighted_sync_gains_from_more_workers_when_each_brings_its_shard() -> None:
    # With a shard on every host the bytes per host stay 2(N-1)/N of the model, so each
    # worker's transfer time does not grow with N and a larger cluster (the same groups in the
    # same ratio) can only shorten the epoch. With a fixed K it need not: every member adds a
    # piece to each shard's link, which the planner's per-worker transfer times only show after
    # the fact (see docs/scale.md).
    spec = {**SPEC, "model_mb": 100, "global_batch": 4096, "samples": 4096 * 20}
    spec["groups"] = [
        {"name": "A100", "count": 1, "per_sample_ms": 0.4, "fixed_ms": 5, "jitter": 0.02},
        {"name": "T4", "count": 2, "per_sample_ms": 2.4, "fixed_ms": 5, "jitter": 0.02},
    ]
    base = cluster_from_spec(spec)
    epochs = []
    for n in (6, 12, 24, 48):
        cluster = dataclasses.replace(base.with_workers(n), shards=n, colocated=True)
        epochs.append(simulate(cluster, "weighted-sync", max_rounds=20).epoch_s)
    assert all(b <= a * 1.001 for a, b in itertools.pairwise(epochs)), epochs
    assert epochs[-1] < 0.5 * epochs[0]


def test_validation_of_some_modes_runs_only_what_their_predictions_need(tmp_path: Path) -> None:
    setup = Setup(tmp_path, tmp_path / "x.h5", "hsi-cnn", "1,2", "1,1", 1, 64, 1, ("async",))
    assert [mode for mode, _, _ in setup.predictions()] == ["async", "async"]
    assert setup.order() == [
        ("cal", "ps"), ("cal", "ps"), ("cal", "async"), ("run", "async"), ("cal", "async")
    ]  # fmt: skip
    everything = Setup(tmp_path, tmp_path / "x.h5", "hsi-cnn", "1,2", "1,1", 1, 64, 1)
    assert everything.order() == list(ORDER)


def test_multihost_figures_come_from_a_bench_run(tmp_path: Path) -> None:
    record = tmp_path / "multihost.json"
    figures = {
        "allreduce_s": 0.52, "compute_s": 0.27, "comm_s_ps-kN": 0.61, "compute_s_ps-kN": 0.58,
        "comm_s_ps-kN-bf16": 0.33, "comm_s_ps-kN-pull": 0.7,  # not a simulated layout
    }  # fmt: skip
    record.write_text(json.dumps({"figures": figures, "date": "d", "command": "c"}))
    measured = kept_figures(record)
    assert measured["compute_s"] == 0.27
    assert measured["communication_s"] == {"ddp": 0.52, "ps-kN": 0.61, "ps-kN-bf16": 0.33}
    assert measured["layout_compute_s"] == {"ps-kN": 0.58}  # what the run recorded
    del figures["allreduce_s"]
    record.write_text(json.dumps({"figures": figures, "date": "d", "command": "c"}))
    with pytest.raises(ValueError, match="no all-reduce reference"):
        kept_figures(record)


def test_validation_runs_take_the_budgets_and_equal_ranks_the_largest(tmp_path: Path) -> None:
    plain = Setup(tmp_path, tmp_path / "x.h5", "hsi-cnn", "1", "1,1,1", 1, 64, 1)
    assert plain.budget_args() == [] and plain.budget_args(equal=True) == []
    budgets = dataclasses.replace(plain, node_cpus="0.6,0.3,0.15", server_cpus="0.4")
    assert budgets.budget_args() == ["--node-cpus", "0.6,0.3,0.15", "--server-cpus", "0.4"]
    assert budgets.budget_args(equal=True) == ["--node-cpus", "0.6", "--server-cpus", "0.4"]


@pytest.mark.parametrize("compute_s", [0.05, 0.2, 2.0])
def test_pushes_leave_while_backward_runs_all_but_the_last_chunk(compute_s: float) -> None:
    n = 4
    per_sample = compute_s / (256 / n)
    nodes = [Node(f"gpu#{i}", 0.0, per_sample, link_bytes_s=GBIT, latency_s=0.0) for i in range(n)]
    cluster = _cluster(nodes, shards=n, colocated=True, chunk_mb=4.0, backward_share=0.5)
    one_way = (n - 1) / n * MODEL * 4 / GBIT  # what the ring moves each way
    lead = min(0.5 * compute_s, one_way - 4 * MB / GBIT)
    overlapped = simulate(cluster, "equal-sync").round_s
    assert overlapped == pytest.approx(2 * one_way + compute_s - lead, rel=0.01)
    after = simulate(dataclasses.replace(cluster, backward_share=0.0), "equal-sync").round_s
    assert after == pytest.approx(2 * one_way + compute_s, rel=0.01)


def test_multihost_figures_default_to_the_kept_bench_record() -> None:
    measured = kept_figures()
    assert set(measured["communication_s"]) == set(MULTIHOST_LAYOUTS)
    assert set(measured["layout_compute_s"]) == set(MULTIHOST_LAYOUTS) - {"ddp"}
    assert measured["source"].startswith("multihost-1gbit-equal-sync.json")


def _spec_file(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("groups: [{name: CPU, count: 2, per_sample_ms: 1, colour: red}]",
         r"c.yaml: group CPU: unknown keys \['colour'\]"),
        ("link: {gbit: 10, mtu: 9000}\ngroups: [{count: 1, per_sample_ms: 1}]",
         r"c.yaml: link: unknown keys \['mtu'\]"),
        ("server: {step_ms: 1, steps_ms: 2}\ngroups: [{count: 1, per_sample_ms: 1}]",
         r"c.yaml: server: unknown keys \['steps_ms'\]"),
        ("groups: [{name: GPU, count: 1, per_sample_ms: 1}, {name: CPU, per_sample_ms: x}]",
         r"c.yaml: group CPU: per_sample_ms must be a number, got 'x'"),
        ("groups: [{count: 1, per_sample_ms: 1}, {count: 2}]",
         r"c.yaml: group #2: per_sample_ms must be a number, got None"),
        ("groups: [{name: A, count: 1e9, per_sample_ms: 1}]",
         r"c.yaml: group A: count must be in \[1, 100000\]"),
        ("groups: [{name: A, count: 2, per_sample_ms: 1e-320}]",
         r"c.yaml: group A: per_sample_ms must be in \[1e-06, 1e\+09\]"),
        ("link: {gbit: 1e-320}\ngroups: [{count: 1, per_sample_ms: 1}]",
         r"c.yaml: link: gbit must be in"),
        ("link: {latency_ms: -5}\ngroups: [{count: 1, per_sample_ms: 1}]",
         r"c.yaml: link: latency_ms must be in \[0, 1e\+06\], got -5"),
        ("staleness: sqrt\ngroups: [{count: 1, per_sample_ms: 1}]",
         r"c.yaml: staleness must be one of"),
        ("global_batch: [64\n", r"c.yaml: line \d+, column \d+: expected ',' or ']'"),
    ],
    ids=["group-key", "link-key", "server-key", "group-value", "unnamed-group", "huge-count",
         "subnormal-cost", "subnormal-link", "negative-latency", "staleness", "yaml-syntax"],
)  # fmt: skip
def test_spec_files_are_read_strictly_and_errors_name_the_file_and_group(
    tmp_path: Path, text: str, message: str
) -> None:
    head = "model_params: 1e6\nglobal_batch: 64\nsamples: 1000\n"
    path = _spec_file(tmp_path, text if "[64" in text else head + text)
    result = CliRunner().invoke(main, ["simulate", "--spec", str(path)])
    assert result.exit_code == 1 and result.exception is not None
    assert isinstance(result.exception, SystemExit), result.exception  # no traceback
    (line,) = result.output.strip().splitlines()
    assert line.startswith("Error: cluster spec ") and re.search(message, line), line


def test_a_run_too_long_to_simulate_asks_for_rounds_and_a_fifo_never_hangs(
    tmp_path: Path,
) -> None:
    path = _spec_file(
        tmp_path,
        "model_params: 1e6\nglobal_batch: 1\nsamples: 1e12\n"
        "groups: [{count: 2, per_sample_ms: 1}]\n",
    )
    refused = CliRunner().invoke(main, ["simulate", "--spec", str(path), "--mode", "ddp"])
    assert refused.exit_code == 1 and "give --rounds R" in refused.output
    assert isinstance(refused.exception, SystemExit)
    taken = CliRunner().invoke(main, ["simulate", "--spec", str(path), "--rounds", "5"])
    assert taken.exit_code == 0, taken.output
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "metrics.jsonl")
    (run / "summary.json").write_text("{}")
    fifo = CliRunner().invoke(main, ["simulate", "--from", str(run)])  # returns at once
    assert fifo.exit_code == 1 and "is not a regular file" in fifo.output


def test_the_simulator_shows_groups_those_that_sit_out_ddp_without_them_and_binding_links(
    tmp_path: Path,
) -> None:
    path = _spec_file(
        tmp_path,
        "model_params: 11.7e6\nglobal_batch: 256\nsamples: 5120\ncolocated: false\n"
        "groups:\n  - {name: GPU, count: 2, per_sample_ms: 0.5, fixed_ms: 5}\n"
        "  - {name: CPU, count: 6, per_sample_ms: 40, fixed_ms: 20}\n",
    )
    args = ["simulate", "--spec", str(path), "--mode", "weighted-sync,ddp"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    lines = result.output.split("Node groups (members a round, share of the samples):\n")[1]
    ws, out, binds, ddp = lines.strip().splitlines()
    assert re.fullmatch(
        r"weighted-sync: GPU 2\.0 of 2 a round, 9\d\.\d % of the samples; "
        r"CPU 0\.\d of 6 a round, 0\.\d % of the samples",
        ws,
    ), ws
    gpu_only = cluster_from_spec(
        {"model_params": 11.7e6, "global_batch": 256, "samples": 5120, "colocated": False,
         "groups": [{"name": "GPU", "count": 2, "per_sample_ms": 0.5, "fixed_ms": 5}]}
    )  # fmt: skip
    alone = simulate(gpu_only, "ddp").epoch_s
    assert out.startswith(f"  CPU sits out; DDP on the other nodes alone: {alone:.4g} s an epoch")
    assert binds.startswith("  the busiest shard host's link binds: ")
    assert "--sweep shards=1,2,4,8 shows how many" in binds
    assert ddp == (
        "ddp: GPU 2.0 of 2 a round, 25.0 % of the samples; CPU 6.0 of 6 a round, 75.0 % of the "
        "samples"
    )
    shards = CliRunner().invoke(main, [*args, "--shards", "8", "--json"])
    doc = json.loads(shards.output)
    assert not [n for n in doc["notes"] if "binds" in n]  # eight shards spread the traffic
    assert doc["results"][0]["groups"]["CPU"]["nodes"] == 6
