"""The multi-host bench's parts: emulated hosts with capped links (root), config, variants."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench.multihost.config import BenchConfig, Variant
from bench.multihost.jobs import _rounds
from bench.multihost.report import table
from common.errors import ConfigError
from launch.cluster.netns import NetConfig, available
from launch.cluster.spec import rate_bits


def test_rates_and_config_validation() -> None:
    assert rate_bits("1gbit") == 1_000_000_000
    assert rate_bits("100mbit") == 100_000_000
    assert rate_bits("2.5Mbit") == 2_500_000
    for bad in ("fast", "0mbit", "10mbps", ""):
        with pytest.raises(ConfigError, match="rate"):
            rate_bits(bad)
    with pytest.raises(ConfigError, match="prefix"):
        NetConfig(rates=("1gbit", "1gbit"), prefix="Bad-prefix").validate()
    with pytest.raises(ConfigError, match="subnet"):
        NetConfig(rates=("1gbit", "1gbit"), subnet="8.8.8").validate()
    with pytest.raises(ConfigError, match="hosts"):
        NetConfig(rates=("1gbit",)).validate()
    with pytest.raises(ConfigError, match="needs 4 rates"):
        BenchConfig(workers=3, rates=("1gbit",) * 3).validate()
    with pytest.raises(ConfigError, match="unknown variants"):
        BenchConfig(variants=("ps-k9",)).validate()


def test_shard_placement_skips_the_slow_host() -> None:
    rates = ("1gbit", "1gbit", "1gbit", "100mbit")
    every = Variant("a", options=("--shards", "{shards}"), shards="workers")
    fast = Variant("b", options=("--shards", "{shards}"), shards="fast")
    assert every.shard_hosts(rates) == [1, 2, 3]
    assert fast.shard_hosts(rates) == [1, 2]
    assert fast.server_options(rates) == ["--shards", "2"]
    assert Variant("c").shard_hosts(rates) == []


def test_round_records_give_communication_time(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"

    def record(seconds: float, *workers: tuple[str, int, float]) -> dict:
        entries = [{"worker": n, "batch": b, "speed": s} for n, b, s in workers]
        return {"event": "round", "t": 1.0, "round_s": seconds, "workers": entries}

    events = [
        {"event": "start", "t": 0.0},
        record(9.0, ("w1", 8, 8.0)),
        record(3.0, ("w1", 8, 16.0), ("w2", 4, 4.0)),
    ]
    metrics.write_text("\n".join(json.dumps(e) for e in events) + "\n")
    report = _rounds(tmp_path, warmup=1)
    assert report["round_s"] == [3.0]
    assert report["compute_s"] == [1.0]  # the slower worker: 4 samples at 4 samples/s
    assert report["comm_s"] == [2.0]
    assert report["compute_source"] == "batch / speed"
    events[2]["workers"][1]["compute_s"] = 1.5
    events[2]["workers"][0]["compute_s"] = 0.5
    metrics.write_text("\n".join(json.dumps(e) for e in events) + "\n")
    report = _rounds(tmp_path, warmup=1)
    assert report["compute_s"] == [1.5] and report["comm_s"] == [1.5]
    assert report["compute_source"] == "round records"


def test_not_root_is_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert available() == "network namespaces need root"


def test_table_ratios_by_hand() -> None:
    cfg = BenchConfig(variants=("ps-k1", "ps-k1-local", "ps-kN"))
    gloo = [{"allreduce_s": [0.5, 0.5, 0.7], "compute_s": [0.25, 0.9], "ddp_step_s": [1.0]}]
    ps = {
        "ps-k1": [
            {"round_s": [3.0, 2.5], "comm_s": [2.5, 2.0], "compute_s": [0.5, 0.5],
             "compute_source": "batch / speed", "batches": {"w1": 8}},
        ],
        "ps-k1-local": [],
        "ps-k1-small": [
            {"round_s": [0.9], "comm_s": [0.8], "compute_s": [0.1],
             "compute_source": "round records", "batches": {"w1": 1}},
        ],
    }  # fmt: skip
    text, figures = table(cfg, gloo, ps, {"ps-k1-local": ["it broke"], "ps-kN": ["no run"]})
    assert figures["reference"]["reference_s"] == pytest.approx(0.75)  # 0.5 + fastest 0.25
    row = figures["variants"]["ps-k1"]
    assert row["estimated_round_s"] == pytest.approx(2.25 + 0.25)  # median comm + solo compute
    assert row["ratio_reference"] == pytest.approx(2.5 / 0.75)
    assert row["ratio_comm_allreduce"] == pytest.approx(2.25 / 0.5)
    assert row["ratio_ddp_step"] == pytest.approx(2.75 / 1.0)
    small = figures["variants"]["ps-k1-small"]  # set against its own workers' compute
    assert small["ratio_reference"] == pytest.approx((0.8 + 0.1) / (0.5 + 0.1))
    assert small["ratio_comm_allreduce"] == pytest.approx(0.8 / 0.5)
    lines = text.splitlines()
    assert all(line.count("|") == 10 for line in lines)
    assert any("ps-kN" in line and "failed: no run" in line for line in lines)
    assert any("ps-k1-local" in line and "failed: it broke" in line for line in lines)
    given = BenchConfig(variants=("ps-k1",), compute_s=0.05)
    _, figures = table(given, gloo, ps, {})
    assert figures["variants"]["ps-k1"]["ratio_reference"] == pytest.approx(2.3 / 0.55)
