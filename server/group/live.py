"""A live video's directions, read from the job store on rank 0 (``SampleControl.extend``).

Invariants:
- The group asks for directions only once every directed window is made (``cp_infer.sampler``), so a direction
  applies from the first window not yet started; the answer is rank 0's and the sampler hands it to every rank.
- The directions are the job store's (``JobStore.direct`` writes them with the job): a job resumed after a crash
  goes on with every direction it had taken, and its request grows in the store with the video
  (``JobStore.set_live_request``), so ``GET /v1/videos/{id}`` shows its frames and prompt segments so far.
- Waiting (everything directed made, no end directed) lasts at most ``idle_s`` without a new direction: the video
  then ends there, completed, its directions marked ended in the store first (a direction that comes later is
  refused, never taken and lost). Each ask returns within ``_ASK_S``, so a cancel (the sampler's poll between asks)
  stops a waiting job at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from cp_infer.live import WAIT, directed_windows, live_request
from cp_infer.options import ModelOptions
from cp_infer.request import GenerationRequest
from server.group.job_record import Live
from server.group.jobs import LiveRefused

__all__ = ["LiveDirector"]

_ASK_S = 0.25
"""How long one ask waits for a new direction before answering WAIT."""


class LiveDirector:
    """``extend`` for one running live job (rank 0's; see the module docstring)."""

    def __init__(self, store, job, *, options: ModelOptions, idle_s: float, contact: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic):
        self.store, self.job, self.options, self.idle_s = store, job, options, idle_s
        self._contact, self._clock = contact, clock
        self.directed = directed_windows(job.live.directions)
        """Windows of the request the group makes now."""
        self._idle_since: float | None = None

    def request(self, resolved: GenerationRequest) -> GenerationRequest:
        """The job's request with the directions it has now (``resolved``: its stored request, resolved), stored with
        the job where directions came before it started."""
        job = self.store.get(self.job.id) or self.job
        live = job.live or self.job.live
        self.directed = directed_windows(live.directions)
        grown = live_request(resolved, live.directions, self.options)
        if grown != resolved:
            self.store.set_live_request(job.id, grown, attempt=self.job.attempts)
        return grown

    def extend(self, passes_done: int, request: GenerationRequest) -> Any:
        deadline = self._clock() + _ASK_S
        while True:
            self._contact()  # waiting is not a hung group
            job = self.store.get(self.job.id)
            if job is None:  # deleted: the next poll cancels it
                return WAIT
            live = job.live
            if directed_windows(live.directions) > self.directed:
                self.directed = directed_windows(live.directions)
                self._idle_since = None
                grown = live_request(request, live.directions, self.options)
                self.store.set_live_request(job.id, grown, attempt=self.job.attempts)
                return grown
            if live.ended:
                return None
            now = self._clock()
            if self._idle_since is None:
                self._idle_since = now
                # Every directed window made: window == windows shows the wait.
                self.store.set_window(job.id, self.directed, self.directed, attempt=self.job.attempts)
            if now - self._idle_since >= self.idle_s:
                return self._end()
            if now >= deadline:
                return WAIT
            time.sleep(0.05)

    def _end(self) -> Any:
        """End the video after the idle time: its directions marked ended in the same guarded write that checks no
        direction came in since they were read (one that did is made: WAIT, and the next ask takes it), so a
        direction is either made or refused (409), never taken and lost."""
        directed = self.directed

        def close(_job, live: Live) -> Live:
            if directed_windows(live.directions) > directed:
                raise _Grew
            return Live(live.directions, ended=True)

        try:
            self.store.direct(self.job.id, close)
        except _Grew:
            return WAIT
        except LiveRefused:
            pass  # ended already (its end directed, or the job is ending): nothing more comes
        return None


class _Grew(Exception):
    """A direction came in between the read and the end."""
