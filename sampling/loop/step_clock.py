"""Where a speculative step's time goes: seconds per phase, for `SpeculativeStats(timed=True)`."""

from __future__ import annotations

import time

import torch

from utils.runners.passes import synchronize


class StepClock:
    """Laps of one loop: `lap(phase)` adds the seconds since the previous lap to `seconds[phase]`,
    so every moment of the loop belongs to exactly one phase. Off (`seconds` None), a lap does
    nothing. On an accelerator a lap first waits for the work queued on every device the model
    spans, else its time would land in a later phase; on the CPU the work is done when a call returns."""

    def __init__(self, seconds: dict[str, float] | None, devices: tuple[torch.device, ...]) -> None:
        self.seconds = seconds
        self.devices = tuple(d for d in devices if d.type not in ("cpu", "meta")) if seconds is not None else ()
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.seconds is None:
            return
        if self.devices:
            synchronize(*self.devices)
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.last
        self.last = now
