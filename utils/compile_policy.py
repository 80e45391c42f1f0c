"""Whether compiling pays for a model on this machine: `load_model(compile=...)` asks here.

`compile="auto"` (the default of `load_model`) compiles a decoder-only model of at least
`AUTO_MIN_PARAMETERS` (where a pass streams hundreds of MB of weights and the kernels, not Python,
set its time) unless a verdict stored for this model and machine says it does not pay. A first
verdict is measured right after compiling: the one-token pass compiled against eager, interleaved,
medians (`measure`); compiled must be at least `PAYS_BELOW` of eager's time, else the model stays
eager. The verdict is stored under `cache_dir()/compiled/` (keyed like the pass costs,
`utils.calibration.calibration_key`), so that a later start neither measures nor, where it did
not pay, compiles. A busy machine's verdict is not stored (`utils.calibration.CoreWatch`).
`SPECDEC_COMPILE=0` turns "auto" off (the test suite sets it); `compile=True` compiles whatever
the verdict, `compile=False` never.
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

from utils.calibration import CoreWatch, calibration_key
from utils.paths import cache_dir
from utils.runners import SequenceRunner
from utils.runners.compiled import compile_model, compiled_passes, forget
from utils.runners.model_info import context_length, is_encoder_decoder
from utils.runners.static import StaticSequence

__all__ = ["AUTO_MIN_PARAMETERS", "COMPILE_ENV", "PAYS_BELOW", "apply", "measure"]

COMPILE_ENV = "SPECDEC_COMPILE"  # "0": compile="auto" compiles nothing
AUTO_MIN_PARAMETERS = 300_000_000  # a model's size, not a machine's speed: below it Python's overhead dominates
PAYS_BELOW = 0.95  # compiled one-token pass / eager one-token pass that counts as paying
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
    return verdict is None or bool(verdict["pays"])


def apply(model: PreTrainedModel, compile: bool | str, *, progress: bool = True) -> bool:
    """Compile `model` as `compile` says (True, False or "auto") -> whether it runs compiled."""
    if compile not in (True, False, "auto"):
        raise ValueError(f"compile must be True, False or 'auto', got {compile!r}")
    if not _wanted(model, compile):
        return False
    start = time.perf_counter()
    if compile_model(model, progress=progress) is None:
        return False  # it said why, in one warning
    if compile is True or _stored_verdict(model) is not None:
        return True
    watch = CoreWatch()
    verdict = measure(model) | {"compile_seconds": time.perf_counter() - start}
    verdict["pays"] = verdict["compiled_seconds"] <= PAYS_BELOW * verdict["eager_seconds"]
    if not watch.busy():
        path = _verdict_path(model)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(verdict, indent=1))
    if not verdict["pays"]:
        forget(model)
    return verdict["pays"]
