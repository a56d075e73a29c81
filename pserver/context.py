"""What the coordinator's components share: the run's context and its books."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from common.protocol.ending import FinishReason
from common.training.runlog import RunLog
from pserver.config import ServerConfig
from pserver.membership import Roster
from pserver.policies import ModePolicy
from pserver.runstate import RunState
from pserver.sampler import EpochSampler
from pserver.updates import Updater


@dataclasses.dataclass(frozen=True)
class RunContext:
    """The run every component acts in.

    Attributes:
        config: the server configuration.
        run: the run's record and lifecycle.
        log: the run log.
        finish: ends training (``finish(reason)``).
        fail: ends the run with an error (``fail(why, stores_lost)``).
        checkpoint: starts a checkpoint in the background.
    """

    config: ServerConfig
    run: RunState
    log: RunLog
    finish: Callable[[FinishReason], None]
    fail: Callable[[str, bool], None]
    checkpoint: Callable[[], None]


@dataclasses.dataclass(frozen=True)
class RunBooks:
    """What the run has planned and done: what a checkpoint keeps and the status reports.

    Attributes:
        sampler: the epoch ledgers.
        roster: the workers.
        policy: the mode policy.
        updater: the published version and its counters.
    """

    sampler: EpochSampler
    roster: Roster
    policy: ModePolicy
    updater: Updater
