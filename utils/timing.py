"""Timing a few choices against each other where the code runs: `interleaved_medians`, for the measurements that pick
a kernel or a dtype once per machine (`utils.loading.fastest_dtype`, `utils.lean.flash.chosen`). Imports nothing of
ours (the lean forward asks it too)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

__all__ = ["interleaved_medians"]


def interleaved_medians(choices: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Each choice's median seconds over `rounds` rounds after a warm-up one, the choices taking turns within a round
    (a burst of load on the machine lands on every choice alike). `choices`: name -> a call to time."""
    times: dict[str, list[float]] = {name: [] for name in choices}
    for round_ in range(rounds + 1):
        for name, run in choices.items():
            start = time.perf_counter()
            run()
            if round_:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(seconds) for name, seconds in times.items()}

