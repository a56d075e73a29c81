"""When a worker the planner left at 0 samples gets a probe again (one sample, or the minimum
local batch of a BatchNorm model).

A worker planned at 0 is probed after ``PROBE_EVERY`` rounds at 0; each probe that leaves it at
0 doubles the wait for the next, up to ``PROBE_EVERY_MAX`` (a worker that stays slow, such as
one behind a 100 Mbit/s link, costs fewer slow rounds). Planned in again, its wait is back to
``PROBE_EVERY``. A worker whose last probe ran far faster than its model predicts (the start
of a change point, see ``perfmodel.Shift``) is probed again at once, so a recovery is confirmed
within a few rounds. The server's weighted-sync policy and the cluster simulator both plan with it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

PROBE_EVERY = 20  # rounds after which a worker planned at 0 samples gets one sample again
PROBE_EVERY_MAX = 320  # the wait doubles after each probe that left it at 0, up to this


class ProbeSchedule:
    """The probe back-off of a set of workers, advanced once per plan."""

    def __init__(self) -> None:
        self.idle_rounds: dict[int, int] = {}  # worker id -> rounds planned at 0 in a row
        self.probe_after: dict[int, int] = {}  # worker id -> rounds at 0 before its next probe

    def due(self, workers: Collection[int], recovering: Collection[int] = ()) -> list[int]:
        """The workers among ``workers`` to give a probe sample in the next plan: those at 0
        for their wait, and at once those in ``recovering`` (their last steps ran far faster
        than predicted) that are at 0 or were just probed."""
        return [
            w
            for w in workers
            if self.idle_rounds.get(w, 0) >= self._wait(w)
            or (w in recovering and (w in self.idle_rounds or w in self.probe_after))
        ]

    def planned(
        self, workers: Collection[int], sizes: Mapping[int, int], probe: Collection[int]
    ) -> None:
        """Advance the schedule after a plan.

        Args:
            workers: every worker the plan considered.
            sizes: the plan (worker id -> batch; ids at 0 may be omitted).
            probe: the workers ``due`` returned for this plan.
        """
        self.idle_rounds = {w: self.idle_rounds.get(w, 0) + 1 for w in workers if not sizes.get(w)}
        for w in workers:
            if w in probe:  # if the probe brings it back, the next plan resets the wait
                self.probe_after[w] = min(2 * self._wait(w), PROBE_EVERY_MAX)
            elif sizes.get(w):
                self.probe_after.pop(w, None)

    def _wait(self, worker_id: int) -> int:
        return self.probe_after.get(worker_id, PROBE_EVERY)
