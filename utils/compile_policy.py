"""Whether a model runs compiled on this machine: `load_model(compile=...)` asks here.

Compiled passes are built once per model and machine and kept on disk (`utils/runners/compile_cache.py`:
inductor's FX-graph cache under `SPECDEC_CACHE/inductor`), so the first start compiles (minutes for a
1.5B model, with a progress bar per width) and a later one loads its graphs (seconds a width: tracing
and freezing, no code generation and no autotuning). Whether the graphs pay is measured once, at the
first compile: each compiled width's pass against the eager pass over as many tokens (interleaved,
medians, `measure`), stored under `cache_dir()/compiled/` (keyed like the pass costs,
`utils.machine.calibration_key`; a busy machine's verdict is not stored, so the next start measures
again). A width pays where its compiled pass takes at most `PAYS_BELOW` of eager's; the others run
eager (never slower than they were), and a machine where no width pays keeps the model eager.

- `compile="auto"` (the default): a decoder-only model of at least `AUTO_MIN_PARAMETERS` compiles on
  its first use on a machine, then follows the verdict: the paying widths from the cache, or eager where
  none pays. The built-in SmolLM2-135M and the tiny test models stay eager. `SPECDEC_COMPILE=0` turns it
  off (the test suite sets it).
- `compile=True` compiles every width and measures the verdict again (e.g. after a kernel change).
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
from utils.runners.compiled import DEFAULT_WIDTHS, compile_model, compiled_passes, forget, keep_widths
from utils.runners.model_info import context_length, is_encoder_decoder
from utils.runners.static import StaticSequence

__all__ = ["AUTO_MIN_PARAMETERS", "COMPILE_ENV", "PAYS_BELOW", "apply", "measure", "paying_widths", "stored_verdict"]

COMPILE_ENV = "SPECDEC_COMPILE"  # "0": compile="auto" compiles nothing
AUTO_MIN_PARAMETERS = 300_000_000  # a model's size, not a machine's speed: below it Python's overhead dominates
PAYS_BELOW = 0.95  # compiled pass / eager pass over as many tokens that counts as paying
CONTEXT = 256  # tokens in the cache while the verdict is measured
REPEATS = 5


def _verdict_path(model: PreTrainedModel) -> Path:
    key = json.dumps(calibration_key(model) | {"compiled": None}, sort_keys=True)
    return cache_dir() / "compiled" / (hashlib.sha256(key.encode()).hexdigest()[:20] + ".json")


def stored_verdict(model: PreTrainedModel) -> dict | None:
    """The verdict measured for `model` on this machine (None: it never compiled here, or an older
    release measured it otherwise)."""
    try:
        verdict = json.loads(_verdict_path(model).read_text())
    except (OSError, ValueError):
        return None
    return verdict if isinstance(verdict, dict) and isinstance(verdict.get("widths"), dict) else None


def measure(model: PreTrainedModel, repeats: int = REPEATS) -> dict[int, dict[str, float]]:
    """Each compiled width's pass of `model` (registered by `compile_model`) and the eager pass over as
    many new tokens, after `CONTEXT` tokens, interleaved -> {width: {"eager_seconds", "compiled_seconds"}}
    (medians; the first round warms up)."""
    passes = compiled_passes(model)
    assert passes is not None, "measure a compiled model"
    limit = context_length(model) or CONTEXT + max(passes.widths) + 1
    context = torch.arange(3, 3 + min(CONTEXT, limit - max(passes.widths) - 1)).tolist()
    eager, compiled = SequenceRunner(model), StaticSequence(model, slots=passes.slots, compiled=passes)
    times: dict[tuple[int, str], list[float]] = {}
    for runner in (eager, compiled):
        runner.forward(context)
    for round_ in range(repeats + 1):
        for width in passes.widths:
            for name, runner in (("eager_seconds", eager), ("compiled_seconds", compiled)):
                start = time.perf_counter()
                runner.forward(list(range(5, 5 + width)))
                if round_:
                    times.setdefault((width, name), []).append(time.perf_counter() - start)
                runner.rollback(len(context))
    return {width: {name: statistics.median(times[width, name]) for name in ("eager_seconds", "compiled_seconds")}
            for width in passes.widths}


def paying_widths(verdict: dict) -> tuple[int, ...]:
    """The widths whose compiled pass a verdict measured at most `PAYS_BELOW` of the eager one."""
    return tuple(sorted(int(width) for width, seconds in verdict["widths"].items()
                        if seconds["compiled_seconds"] <= PAYS_BELOW * seconds["eager_seconds"]))


def _parameters(model: PreTrainedModel) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


def _description(model: PreTrainedModel, first: bool) -> str:
    """The progress bar's words: a later start loads; a first compile says how long it should take,
    from the compiles this machine has done (seconds per parameter of each stored verdict)."""
    if not first:
        return "loading compiled passes"
    rates = []
    for path in (cache_dir() / "compiled").glob("*.json"):
        try:
            verdict = json.loads(path.read_text())
            rates.append(verdict["compile_seconds"] / verdict["parameters"])
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
            continue
    if not rates:
        return "compiling, once on this machine (minutes)"
    minutes = statistics.median(rates) * _parameters(model) / 60
    return f"compiling, once on this machine (about {max(1, round(minutes))} min)"


def _wanted(model: PreTrainedModel, compile: bool | str) -> tuple[int, ...]:
    """The widths to compile (): none)."""
    if compile is True:
        return DEFAULT_WIDTHS
    if compile is False or os.environ.get(COMPILE_ENV) == "0" or is_encoder_decoder(model):
        return ()
    if _parameters(model) < AUTO_MIN_PARAMETERS:
        return ()
    verdict = stored_verdict(model)
    return DEFAULT_WIDTHS if verdict is None else paying_widths(verdict)


def apply(model: PreTrainedModel, compile: bool | str, *, progress: bool = True) -> bool:
    """Compile `model` as `compile` says (True, False or "auto") -> whether it runs compiled."""
    if compile not in (True, False, "auto"):
        raise ValueError(f"compile must be True, False or 'auto', got {compile!r}")
    widths = _wanted(model, compile)
    if not widths:
        return False
    measured = compile is True or stored_verdict(model) is None
    start = time.perf_counter()
    passes = compile_model(model, widths=widths, progress=progress, description=_description(model, measured))
    if passes is None:
        return False  # it said why, in one warning
    if not measured:
        return True
    watch = CoreWatch()
    verdict = {"widths": measure(model), "compile_seconds": time.perf_counter() - start,
               "parameters": _parameters(model)}
    if not watch.busy():
        path = _verdict_path(model)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(verdict, indent=1))
    kept = paying_widths(verdict)
    if not kept:
        forget(model)
        return False
    keep_widths(model, kept)
    return True
