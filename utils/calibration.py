"""Calibration: what a pass over 1 + k new tokens costs here, measured once and cached.

1. `calibrate(model)` times passes over 1 + k new tokens (k = 0 and `DRAFT_SIZES`) after a context of
   `CONTEXT` tokens, interleaved over repeats (a slow moment spreads over every k), each with every
   combination of the CPU shortcuts of `utils/cpu_passes.py`, and keeps for each k the fastest
   combination: the kernel choice is a measurement too. Medians; a calibration whose repeats
   disagree (a busy machine) is taken again, and if it still disagrees, dropped for the prior.
2. `pass_costs(model)` calibrates once per model and caches the result on disk
   (`cache_dir()/costs/`) under a key that changes with the architecture, dtype, device, thread
   count, CPU, torch and transformers versions, attention implementation and the kernels' source.
   The one wait a user sees: a progress bar on stderr says so (`SPECDEC_PROGRESS=0` hides it).

The layering: `utils/cost_model.py` (the costs, no model) <- `utils/caching.py` (the runner uses
and refines them) <- this module (runs the runner to measure them).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import sys
import time
import weakref
from pathlib import Path

import torch
import transformers
from tqdm import tqdm
from transformers import PreTrainedModel

from utils import cost_model, cpu_passes
from utils.caching import ModelRunner, context_length, input_device, is_encoder_decoder, synchronize, vocab_size
from utils.cost_model import DRAFT_SIZES, PassCosts, prior_costs
from utils.cpu_passes import Shortcuts
from utils.loading import cache_dir

__all__ = ["calibrate", "calibration_key", "is_measured", "machine", "pass_costs", "time_passes"]

CONTEXT = 256  # tokens already in the cache when a calibration pass runs
REPEATS = 3
MAX_SPREAD = 0.25  # (max - min) / median of the one-token pass's repeats above this: a busy machine
CALIBRATE_ENV = "SPECDEC_CALIBRATE"  # "0": use PRIOR, measure nothing up front
PROGRESS_ENV = "SPECDEC_PROGRESS"  # "0": no progress bar while calibrating


def time_passes(model: PreTrainedModel, choices: list[Shortcuts], repeats: int) -> dict[tuple[int, Shortcuts], list[float]]:
    """Seconds of each (k, shortcuts) pass, `repeats` times each, interleaved."""
    limit = context_length(model)
    context = CONTEXT if limit is None else max(1, min(CONTEXT, limit - max(DRAFT_SIZES) - 2))
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, min(vocab_size(model), 10_000), (context + max(DRAFT_SIZES) + 1,), generator=generator)
    tokens = tokens.tolist()
    encoder_ids = tokens[:context] if is_encoder_decoder(model) else None
    runner = ModelRunner(model, encoder_input_ids=encoder_ids)
    runner.forward(tokens[:context])
    device = runner.device
    times: dict[tuple[int, Shortcuts], list[float]] = {}
    plan = [(k, choice) for k in (0, *DRAFT_SIZES) for choice in choices]
    # The one wait a user sees (seconds, once per machine and model): say so on stderr, as
    # transformers does while it loads weights.
    progress = tqdm(total=(repeats + 1) * len(plan), desc="Measuring pass costs here (once)",
                    unit="pass", leave=False, file=sys.stderr, disable=os.environ.get(PROGRESS_ENV) == "0")
    for _ in range(repeats + 1):  # the first round warms every shape up and is not kept
        for k, choice in plan:
            progress.update()
            synchronize(device)
            start = time.perf_counter()
            runner.forward(tokens[context : context + k + 1], num_logits=k + 1, shortcuts=choice)
            synchronize(device)
            times.setdefault((k, choice), []).append(time.perf_counter() - start)
            runner.rollback(context)
    progress.close()
    return {key: values[1:] for key, values in times.items()}


def calibrate(model: PreTrainedModel, repeats: int = REPEATS) -> tuple[PassCosts, float]:
    """Measure `model`'s pass costs here -> (costs, spread of the one-token pass's repeats)."""
    choices = cpu_passes.available_shortcuts(model)
    times = time_passes(model, choices, repeats)
    relative, shortcuts = {}, {}
    for k in (0, *DRAFT_SIZES):
        shortcuts[k] = min(choices, key=lambda choice: statistics.median(times[(k, choice)]))
        relative[k] = statistics.median(times[(k, shortcuts[k])])
    one_token = times[(0, shortcuts[0])]
    base = relative[0]
    spread = (max(one_token) - min(one_token)) / base
    relative = {k: seconds / base for k, seconds in relative.items()}
    # A longer pass never costs less than a shorter one in this model: smooth out timing noise.
    for k0, k1 in zip(sorted(relative), sorted(relative)[1:], strict=False):
        relative[k1] = max(relative[k1], relative[k0])
    return PassCosts(relative, base, shortcuts, measured=True), spread


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """The machine that figures were measured on (for reports): CPU, vector extensions, threads,
    versions, GPU if any."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
        flags = next((set(line.split(":", 1)[1].split()) for line in cpuinfo if line.startswith("flags")), set())
    except OSError:
        flags = set()
    return {
        "cpu": _cpu_name(),
        "flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"}),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def calibration_key(model: PreTrainedModel) -> dict:
    """Everything a measured cost depends on; any change means a new calibration."""
    device = input_device(model)
    parameter = next(model.parameters())
    sources = (cpu_passes.__file__, cost_model.__file__, __file__)
    kernels = hashlib.sha256(b"".join(Path(source).read_bytes() for source in sources)).hexdigest()[:12]
    return {
        "model": type(model).__name__,
        "config": hashlib.sha256(model.config.to_json_string(use_diff=False).encode()).hexdigest()[:16],
        "dtype": str(parameter.dtype),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "device_map": str(getattr(model, "hf_device_map", None)),
        "threads": torch.get_num_threads(),
        "cpu": _cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "attention": getattr(model.config, "_attn_implementation", None),
        "kernels": kernels,
    }


_COSTS: weakref.WeakKeyDictionary[PreTrainedModel, PassCosts] = weakref.WeakKeyDictionary()


def pass_costs(model: PreTrainedModel) -> PassCosts:
    """The pass costs of `model` here: from memory, from the disk cache, or calibrated now (a few
    seconds for a 135M model, once per machine and setting). One object per model, so that what
    generation observes online is shared by every later call."""
    costs = _COSTS.get(model)
    if costs is not None:
        return costs
    if os.environ.get(CALIBRATE_ENV) == "0":
        costs = prior_costs()
    else:
        costs = _cached_or_calibrated(model)
    _COSTS[model] = costs
    return costs


def _cache_path(model: PreTrainedModel) -> tuple[dict, Path]:
    key = calibration_key(model)
    return key, cache_dir() / "costs" / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20] + ".json")


def _load(path: Path) -> PassCosts | None:
    try:
        return PassCosts.from_json(json.loads(path.read_text())["costs"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or unreadable: measured again


def is_measured(model: PreTrainedModel) -> bool:
    """Whether `pass_costs(model)` answers without measuring anything (known in memory, cached on
    disk, or calibration switched off): a console can say what it is about to wait for."""
    return model in _COSTS or os.environ.get(CALIBRATE_ENV) == "0" or _load(_cache_path(model)[1]) is not None


def _cached_or_calibrated(model: PreTrainedModel) -> PassCosts:
    key, path = _cache_path(model)
    costs = _load(path)
    if costs is not None:
        return costs
    for _ in range(2):  # a burst of load: measure once more
        costs, spread = calibrate(model)
        if spread <= MAX_SPREAD:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"{path.name}.{os.getpid()}")
            partial.write_text(json.dumps({"key": key, "spread": spread, "costs": costs.to_json()}, indent=1))
            partial.replace(path)
            return costs
    return prior_costs()  # too noisy to trust, and not cached: online observations take over
