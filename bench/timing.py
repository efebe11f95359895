"""Timing shared by the kernel microbenchmarks in this folder."""

from __future__ import annotations

import statistics
import time


def median_seconds(fn, runs: int) -> float:
    """The median wall time of `runs` calls of `fn`, after one untimed call."""
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
