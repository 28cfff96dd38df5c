"""Restarting a worker group that failed, at a bounded rate: ``cp-infer serve --max-restarts N --restart-window-s S``.

Invariants:
- A group is restarted only when its ranks failed (a rank crashed or exited non-zero: ``RoundResult.failure`` is
  set). A group that ended in step (the leader's exit code) or was stopped by a signal is never restarted.
- At most ``max_restarts`` restarts fall within any ``window_s`` seconds (a sliding window over the times the
  restarts were made); the failure that would exceed it ends the command with its exit code and a message that
  names the cause and the two flags. ``max_restarts=0``: no restarts at all.
- The count of restarts so far (0 for the first group) is what each round is started with, so the ranks can report
  it; it only grows, whatever the window forgets.
- Nothing here starts processes or reads a clock other than the one it is given, so the policy is tested as is.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["RestartBudget", "RestartPolicy", "RoundResult", "supervise"]

log = logging.getLogger("cp_infer.restarts")


@dataclass(frozen=True)
class RestartPolicy:
    """How often a failed group is started again."""

    max_restarts: int = 5
    """Most restarts within any ``window_s`` seconds (0: never restart)."""
    window_s: float = 300.0
    """The sliding window the restarts are counted in, in seconds."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts {self.max_restarts} must be >= 0 (0: no restarts)")
        if not self.window_s > 0:
            raise ValueError(f"--restart-window-s {self.window_s} must be > 0 seconds; try 300")

    def describe(self) -> str:
        return f"--max-restarts {self.max_restarts} --restart-window-s {self.window_s:g}"


class RestartBudget:
    """The restarts a :class:`RestartPolicy` still allows, given when the earlier ones were made."""

    def __init__(self, policy: RestartPolicy):
        self.policy = policy
        self._times: deque[float] = deque()

    def in_window(self, now: float) -> int:
        """Restarts made within the last ``window_s`` seconds before ``now``."""
        while self._times and self._times[0] <= now - self.policy.window_s:
            self._times.popleft()
        return len(self._times)

    def take(self, now: float) -> bool:
        """Record a restart at ``now`` and return True, or return False (recording nothing) when the window holds
        ``max_restarts`` already."""
        if self.in_window(now) >= self.policy.max_restarts:
            return False
        self._times.append(now)
        return True


@dataclass(frozen=True)
class RoundResult:
    """How one run of the group ended."""

    code: int
    """The exit code the command would end with."""
    failure: str | None = None
    """Why the ranks failed (``"rank 1 (pid 123) killed by SIGKILL"``); None when the group ended in step or was
    stopped by a signal."""


def supervise(run_round: Callable[[int], RoundResult], policy: RestartPolicy, *,
              clock: Callable[[], float] = time.monotonic) -> int:
    """Run ``run_round(restarts_so_far)`` until it ends without a failure or the policy allows no more restarts;
    return the last round's exit code. Each restart is logged with its cause and counts."""
    budget = RestartBudget(policy)
    restarts = 0
    while True:
        result = run_round(restarts)
        if result.failure is None:
            return result.code
        now = clock()
        if not budget.take(now):
            if policy.max_restarts == 0:
                why = "restarts are off (--max-restarts 0)"
            else:
                why = (f"it was restarted {budget.in_window(now)} time(s) in the last {policy.window_s:g} s already, "
                       f"the most {policy.describe()} allows")
            log.error("the worker group failed (%s) and is not restarted: %s; see the ranks' output above for the "
                      "cause (%d restart(s) in all)", result.failure, why, restarts)
            return result.code or 1
        restarts += 1
        log.warning("the worker group failed (%s); restarting it: restart %d, %d of at most %d in %g s",
                    result.failure, restarts, budget.in_window(now), policy.max_restarts, policy.window_s)
