"""Whether compiling pays for a model on this machine: `load_model(compile=...)` asks here.

A compiled model's graphs take minutes to build at every start: inductor caches its C++ kernels
(`SPECDEC_CACHE/inductor`) but not a graph with frozen, packed weights (its FX-graph cache refuses
oneDNN's packed tensors), so a later start compiles again (measured: `docs/results.md`). Compiling
pays only where the passes it speeds up repay that, so the verdict weighs both:

- `compile=True` compiles, then measures the one-token pass compiled against eager (interleaved,
  medians, `measure`) and stores the verdict under `cache_dir()/compiled/` (keyed like the pass
  costs, `utils.machine.calibration_key`; a busy machine's verdict is not stored). It pays when
  the compiled pass takes at most `PAYS_BELOW` of eager's and the time it saves over
  `PASSES_PER_START` passes exceeds what compiling took.
- `compile="auto"` (the default) compiles a decoder-only model of at least `AUTO_MIN_PARAMETERS`
  where a stored verdict says it pays, and never starts minutes of compiling unasked: with no
  verdict the model stays eager (`compile=True`, or `python -m benchmarks.compiled`, measures one).
  `SPECDEC_COMPILE=0` turns it off (the test suite sets it).
- `compile=False` never compiles.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from pathlib import Path

import torch
from transformers import PreTrainedModel

from utils.calibration import CoreWatch
from utils.machine import calibration_key
from utils.paths import cache_dir
from utils.runners import SequenceRunner
from utils.runners.compiled import compile_model, compiled_passes
from utils.runners.model_info import context_length, is_encoder_decoder
from utils.runners.static import StaticSequence

__all__ = ["AUTO_MIN_PARAMETERS", "COMPILE_ENV", "PASSES_PER_START", "PAYS_BELOW", "apply", "measure", "pays"]

COMPILE_ENV = "SPECDEC_COMPILE"  # "0": compile="auto" compiles nothing
AUTO_MIN_PARAMETERS = 300_000_000  # a model's size, not a machine's speed: below it Python's overhead dominates
PAYS_BELOW = 0.95  # compiled one-token pass / eager one-token pass that counts as paying
PASSES_PER_START = 2000  # passes a start is expected to run (a session's chat, a benchmark): what repays a compile
CONTEXT = 256  # tokens in the cache while the verdict is measured
REPEATS = 5


def _verdict_path(model: PreTrainedModel) -> Path:
    key = json.dumps(calibration_key(model) | {"compiled": None}, sort_keys=True)
    return cache_dir() / "compiled" / (hashlib.sha256(key.encode()).hexdigest()[:20] + ".json")


def _stored_verdict(model: PreTrainedModel) -> dict | None:
    try:
        return json.loads(_verdict_path(model).read_text())
    except (OSError, ValueError):
        return None


def measure(model: PreTrainedModel, repeats: int = REPEATS) -> dict:
    """The one-token pass of `model` (registered by `compile_model`) compiled and eager, after
    `CONTEXT` tokens, interleaved -> {"eager_seconds", "compiled_seconds"} (medians)."""
    passes = compiled_passes(model)
    assert passes is not None, "measure a compiled model"
    limit = context_length(model) or CONTEXT + 2
    context = torch.arange(3, 3 + min(CONTEXT, limit - 2)).tolist()
    eager, compiled = SequenceRunner(model), StaticSequence(model, slots=passes.slots, compiled=passes)
    times: dict[str, list[float]] = {"eager_seconds": [], "compiled_seconds": []}
    for runner in (eager, compiled):
        runner.forward(context)
    for _ in range(repeats + 1):  # the first round warms up and is not kept
        for name, runner in (("eager_seconds", eager), ("compiled_seconds", compiled)):
            start = time.perf_counter()
            runner.forward([5])
            times[name].append(time.perf_counter() - start)
            runner.rollback(len(context))
    return {name: statistics.median(values[1:]) for name, values in times.items()}


def _wanted(model: PreTrainedModel, compile: bool | str) -> bool:
    if compile is True:
        return True
    if compile is False or os.environ.get(COMPILE_ENV) == "0" or is_encoder_decoder(model):
        return False
    if sum(parameter.numel() for parameter in model.parameters()) < AUTO_MIN_PARAMETERS:
        return False
    verdict = _stored_verdict(model)
    return verdict is not None and bool(verdict["pays"])


def pays(verdict: dict) -> bool:
    """Whether a measured verdict says compiling pays (`PAYS_BELOW`, `PASSES_PER_START`)."""
    saved = verdict["eager_seconds"] - verdict["compiled_seconds"]
    return (verdict["compiled_seconds"] <= PAYS_BELOW * verdict["eager_seconds"]
            and saved * PASSES_PER_START >= verdict["compile_seconds"])


def apply(model: PreTrainedModel, compile: bool | str, *, progress: bool = True) -> bool:
    """Compile `model` as `compile` says (True, False or "auto") -> whether it runs compiled."""
    if compile not in (True, False, "auto"):
        raise ValueError(f"compile must be True, False or 'auto', got {compile!r}")
    if not _wanted(model, compile):
        return False
    start = time.perf_counter()
    if compile_model(model, progress=progress) is None:
        return False  # it said why, in one warning
    if compile is True:  # asked: it stays compiled; the verdict is measured for "auto" to follow
        watch = CoreWatch()
        verdict = measure(model) | {"compile_seconds": time.perf_counter() - start}
        verdict["pays"] = pays(verdict)
        if not watch.busy():
            path = _verdict_path(model)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(verdict, indent=1))
    return True
