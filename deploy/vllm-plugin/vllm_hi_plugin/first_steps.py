"""The target engine's first steps after a migration's commit, timed.

On an H100 (2026-12-06) the clients' worst gap of a migration fell after
its commit: the target's first new tokens reached them 66–69 ms after it,
while the moved text of its woken streams was out within 9 ms. Whether the
engine core's first steps over the installed requests are slow, or the API
server's loop is late with their outputs, is what this tells: one line per
commit with when each of the first steps' outputs came back after it, and
how long each step's scheduling took.
"""
from __future__ import annotations

import time


class FirstSteps:
    """Times the STEPS steps after installed requests were committed."""

    STEPS = 4

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.since = None  # the last commit, until its steps are logged
        self.requests = 0
        self.outputs: list[float] = []
        self.schedules: list[tuple[float, int]] = []

    def committed(self, n: int) -> None:
        """n installed requests were committed. Commits before the first
        step's output are one migration's (its installs go one by one)."""
        if self.since is not None and not self.outputs:
            self.requests += n
        else:
            self.requests, self.outputs, self.schedules = n, [], []
        self.since = self.clock()

    def scheduled(self, took_s: float, requests: int) -> None:
        """A step was scheduled: took_s in the scheduler, requests in it."""
        if self.since is not None and len(self.schedules) < self.STEPS:
            self.schedules.append((took_s, requests))

    def output(self) -> str | None:
        """A step's output came back; the line to log once STEPS did."""
        if self.since is None:
            return None
        self.outputs.append(self.clock() - self.since)
        if len(self.outputs) < self.STEPS:
            return None
        self.since = None
        outs = ", ".join(f"{t * 1000:.1f}" for t in self.outputs)
        scheds = ", ".join(f"{n} requests in {t * 1000:.1f} ms" for t, n in self.schedules)
        return (f"vllm_hi the first {self.STEPS} steps after committing {self.requests} installed requests: "
                f"their outputs {outs} ms after the commit (their scheduling: {scheds})")
