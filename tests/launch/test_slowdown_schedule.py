"""Changing heterogeneity: parsing --slowdown-schedules, and weighted-sync following new speeds."""

from __future__ import annotations

import pytest

from common.errors import ConfigError
from launch.slowdowns import parse_schedules, parse_slowdowns


def test_parse_slowdowns() -> None:
    assert parse_slowdowns("1,2,4") == (1.0, 2.0, 4.0)
    assert parse_slowdowns("2", workers=3) == (2.0, 2.0, 2.0)
    for bad in ("1,x", "0.5", "", "1,2"):
        with pytest.raises(ConfigError):
            parse_slowdowns(bad, workers=3)


def test_parse_schedules_forms() -> None:
    three = (1.0, 1.0, 2.0)
    assert parse_schedules("", three) == ()
    assert parse_schedules("100:3", three) == ("100:3",) * 3
    assert parse_schedules(";100:4;50:1,200:2", three) == ("", "100:4", "50:1,200:2")
    assert parse_schedules("1=100:4;2=50:1", three) == ("", "100:4", "50:1")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1:2;3:4", "2 entries for 3 workers"),
        ("5=10:2", "not in"),
        ("1=10:2;1=20:3", "twice"),
        ("1=10:2;20:3;", "mixes"),
        (";abc;", "STEP:FACTOR"),
        (";10:0.5;", ">= 1"),
    ],
)
def test_parse_schedules_rejects(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_schedules(text, (1.0, 1.0, 1.0))
