"""Where a ground-truth run's time went, for its JSON record: seconds per stage, summed over the shards, so
that a slow run says whether it waited on the file, the device or the merge."""

from __future__ import annotations

import time


class Stages:
    """Each done(stage) adds the time since the previous one (or since the run began) to that stage."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def done(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + (now - self._last)
        self._last = now

    def rounded(self) -> dict[str, float]:
        return {stage: round(seconds, 3) for stage, seconds in self.seconds.items()}
