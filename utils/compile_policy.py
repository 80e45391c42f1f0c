"""Whether a model runs compiled on this machine: `load_model(compile=...)` asks here.

Compiled passes are built once per model and machine and kept on disk (`utils/runners/compile_cache.py`:
inductor's FX-graph cache under `SPECDEC_CACHE/inductor`), so the first start compiles (minutes for a
1.5B model, with a progress bar per width) and a later one loads its graphs (seconds a width: tracing
and freezing, no code generation and no autotuning). Whether the graphs pay is measured once, at the
first compile: each compiled width's pass, and the verification widths that run eager over the static
buffer, against the best eager pass over as many tokens (its fastest CPU shortcuts; interleaved,
medians, `measure`), stored under `cache_dir()/compiled/` (keyed like the pass costs,
`utils.machine.calibration_key`; a busy machine's verdict is not stored, so the next start measures
again). A width pays where its compiled pass takes at most `PAYS_BELOW` of eager's; the others run
eager, and a machine where no width pays, or where the static buffer makes an eager verification
pass dearer than `SLOWER_ABOVE`, keeps the model eager.

- `compile="auto"` (the default): a decoder-only model of at least `AUTO_MIN_PARAMETERS` compiles on
  its first use on a machine, then follows the verdict: the paying widths from the cache, or eager where
  none pays. The built-in SmolLM2-135M and the tiny test models stay eager. `SPECDEC_COMPILE=0` turns it
  off (the test suite sets it).
- `compile=True` compiles (`DEFAULT_WIDTHS`) and runs compiled, as asked, whatever the verdict; it measures the
  verdict again (e.g. after a kernel change), which later `compile="auto"` starts follow.
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

from utils import lean
from utils.calibration import CoreWatch
from utils.cpu_passes import Shortcuts, available_shortcuts
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
SLOWER_ABOVE = 1.05  # an eager pass over the static buffer / over the growing cache that a compile may not cost
MEASURED_WIDTHS = (1, 4, 8)  # a step, and verification passes of 3 and 7 drafts
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
    """Each pass width generation runs (`MEASURED_WIDTHS` and the compiled ones) of `model` (registered
    by `compile_model`): through its static buffer (the compiled graph where one holds the width, else
    eager over the buffer) and through the growing cache, after `CONTEXT` tokens, interleaved -> {width:
    {"eager_seconds", "compiled_seconds"}} (medians; the first round warms up). An eager pass takes the
    fastest of its CPU shortcuts (`utils.cpu_passes`), as generation would: the verdict is against the
    best eager path, not transformers' own."""
    passes = compiled_passes(model)
    assert passes is not None, "measure a compiled model"
    widths = sorted(set(MEASURED_WIDTHS) | set(passes.widths))
    limit = context_length(model) or CONTEXT + max(widths) + 1
    context = torch.arange(3, 3 + min(CONTEXT, limit - max(widths) - 1)).tolist()
    eager, compiled = SequenceRunner(model), StaticSequence(model, slots=passes.slots, compiled=passes)
    times: dict[tuple[int, str, Shortcuts], list[float]] = {}
    for runner in (eager, compiled):
        runner.forward(context)
    for round_ in range(repeats + 1):
        for width in widths:
            for name, runner in (("eager_seconds", eager), ("compiled_seconds", compiled)):
                graph = name == "compiled_seconds" and width in passes.widths
                for shortcuts in [Shortcuts()] if graph else available_shortcuts(model):
                    start = time.perf_counter()
                    runner.forward(list(range(5, 5 + width)), shortcuts=shortcuts)
                    if round_:
                        times.setdefault((width, name, shortcuts), []).append(time.perf_counter() - start)
                    runner.rollback(len(context))
    best = {}
    for (width, name, _), values in times.items():
        best[width, name] = min(best.get((width, name), float("inf")), statistics.median(values))
    return {width: {name: best[width, name] for name in ("eager_seconds", "compiled_seconds")} for width in widths}


def paying_widths(verdict: dict) -> tuple[int, ...]:
    """The compiled widths a verdict measured at most `PAYS_BELOW` of the eager pass, or none where a
    width that runs eager over the static buffer measured over `SLOWER_ABOVE` of the growing cache's
    (a compile must not make the passes it does not hold dearer: speculation's verification passes)."""
    widths = {int(width): seconds for width, seconds in verdict["widths"].items()}
    ratio = {width: seconds["compiled_seconds"] / seconds["eager_seconds"] for width, seconds in widths.items()}
    compiled = set(verdict.get("compiled", widths))
    if any(ratio[width] > SLOWER_ABOVE for width in widths if width not in compiled):
        return ()
    return tuple(sorted(width for width in compiled if ratio[width] <= PAYS_BELOW))


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
    if _parameters(model) < AUTO_MIN_PARAMETERS or lean.unsupported(model) is None:
        return ()  # small, or run by our own forward (utils/lean/): nothing to compile on first use
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
    compile_seconds, watch = time.perf_counter() - start, CoreWatch()
    verdict = {"widths": measure(model), "compiled": list(passes.widths), "compile_seconds": compile_seconds,
               "parameters": _parameters(model)}
    if not watch.busy():
        path = _verdict_path(model)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(verdict, indent=1))
    if compile is True:
        return True  # asked for: it runs compiled; "auto" follows the verdict just stored
    kept = paying_widths(verdict)
    if not kept:
        forget(model)
        return False
    keep_widths(model, kept)
    return True
