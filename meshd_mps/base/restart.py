"""A program's restart policy, as systemd's ``Restart=`` and Kubernetes' ``restartPolicy``.

A resident program is meant to run until it is unloaded, so by default (``on-failure``) one that
fails comes back by itself: a worker killed from outside (the OOM killer, an operator), a launch
that failed, a GPU fault it caused.  Its relaunches back off exponentially, and one that fails
``CRASH_LOOP_BURST`` times within ``Deadlines.crash_loop_interval`` is in a crash loop: it is not
relaunched again, and says why, until it is upgraded or loaded anew.  A program lost to another
program's fault did nothing wrong: it is relaunched at once, and that is not counted against it.

Everything here is pure: ``decide`` maps a program's end, its policy and its history of
failures to what to do (tests/rig/test_restart.py).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from meshd_mps.base.deadlines import Deadlines
from meshd_mps.base.errors import BadRestartPolicy

#: Failures within ``Deadlines.crash_loop_interval`` that make a crash loop (systemd's StartLimitBurst).
CRASH_LOOP_BURST = 5


class Policy(enum.Enum):
    ON_FAILURE = "on-failure"  # relaunched when it fails or faults, not when it exits by itself
    ALWAYS = "always"  # also relaunched when its kernel returns by itself
    NEVER = "never"  # never relaunched, not even when another program's fault took it down

    @classmethod
    def parse(cls, value: object) -> Policy:
        """The policy named ``value`` (a Policy, or its name); BadRestartPolicy otherwise."""
        if isinstance(value, Policy):
            return value
        for p in cls:
            if value == p.value:
                return p
        raise BadRestartPolicy(f"restart policy {value!r}: one of {', '.join(p.value for p in cls)}", value=str(value))


#: The default, as a program loaded without one gets it.
DEFAULT = Policy.ON_FAILURE


class End(enum.Enum):
    """How a program's launch ended, as far as its restart is concerned."""

    EXITED = "exited"  # its kernel returned by itself, DONE ok (not halted by us)
    FAILED = "failed"  # its own failure: a stream error, its worker's death
    FAULTED = "faulted"  # it caused a GPU fault that took the GPU's other programs down
    LOST = "lost"  # another program's fault took it down


@dataclass(frozen=True)
class Decision:
    relaunch: bool
    delay: float = 0.0  # seconds to wait first (the backoff)
    crash_loop: bool = False
    failures: tuple[float, ...] = ()  # its failures within the interval, this one included
    why: str = ""  # when not relaunched, in words


def decide(policy: Policy, end: End, failures: Sequence[float], now: float, d: Deadlines) -> Decision:
    """What to do after a program's launch ended ``end`` at ``now`` (monotonic), given the
    monotonic times of its earlier failures.  A lost program is relaunched at once (unless the
    policy is never) and its history is not touched; every other end counts as a failure for the
    crash-loop limit, and its relaunch waits ``restart_backoff`` doubled for each failure before it
    in the interval, at most ``restart_backoff_max``."""
    recent = tuple(t for t in failures if now - t < d.crash_loop_interval)
    if policy is Policy.NEVER:
        return Decision(False, failures=recent, why="restart policy never")
    if end is End.LOST:
        return Decision(True, failures=recent)
    if end is End.EXITED and policy is not Policy.ALWAYS:
        return Decision(False, failures=recent, why=f"exited by itself; restart policy {policy.value}")
    recent = (*recent, now)
    if len(recent) >= CRASH_LOOP_BURST:
        return Decision(False, crash_loop=True, failures=recent,
                        why=f"crash loop: {len(recent)} {_ends(end)} within {d.crash_loop_interval:g}s; not relaunched"
                            " until it is upgraded or loaded again")
    delay = min(d.restart_backoff * 2 ** (len(recent) - 1), d.restart_backoff_max)
    return Decision(True, delay, failures=recent)


def _ends(end: End) -> str:
    return "exits" if end is End.EXITED else "failures"
