"""Mode policies: how pushes are combined into updates. One module per mode, plus staleness."""

from __future__ import annotations

from pserver.policies.asynchronous import AsyncPolicy
from pserver.policies.base import Assignment, Decision, ModePolicy, Update
from pserver.policies.equal_sync import EqualSync
from pserver.policies.weighted_sync import WeightedSync

POLICIES: dict[str, type[ModePolicy]] = {
    "weighted-sync": WeightedSync,
    "equal-sync": EqualSync,
    "async": AsyncPolicy,
}

__all__ = [
    "POLICIES",
    "Assignment",
    "AsyncPolicy",
    "Decision",
    "EqualSync",
    "ModePolicy",
    "Update",
    "WeightedSync",
]
