"""The measured cost of verifying drafts, on the machine, model, dtype and thread count in use.

A speculative step verifies k drafts with one target pass over 1 + k new tokens. A draft pays only
if the tokens it is expected to add outweigh what that pass costs over a one-token pass, and that
cost is a property of the hardware and its kernels, not of the algorithm: with the same code a pass
over 2 tokens of SmolLM2-135M cost 1.05x a one-token pass on one 2-core CPU and 1.84x on another.
So nothing here is one machine's constant:

1. `calibrate(model)` times passes over 1 + k new tokens (k = 0 and `DRAFT_SIZES`) after a context of
   `CONTEXT` tokens, interleaved over repeats (a slow moment spreads over every k), each with every
   combination of the CPU shortcuts of `utils/cpu_passes.py`, and keeps for each k the fastest
   combination: the kernel choice is a measurement too. Medians; a calibration whose repeats
   disagree (a busy machine) is taken again, and if it still disagrees, dropped for the prior.
2. `pass_costs(model)` calibrates once per model and caches the result on disk
   (`cache_dir()/costs/`) under a key that changes with the architecture, dtype, device, thread
   count, CPU, torch and transformers versions, attention implementation and the kernels' source.
3. `PassCosts.observe` refines the estimates online from the passes generation makes anyway
   (a clipped running average per k, so that one burst of load moves nothing far).

`PRIOR` is the documented stand-in before anything is measured (or when calibration is switched
off with SPECDEC_CALIBRATE=0): one CPU's measurement, used with transformers' own kernels.
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
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from tqdm import tqdm
from transformers import PreTrainedModel

from utils import cpu_passes
from utils.cpu_passes import Shortcuts

__all__ = ["DRAFT_SIZES", "PRIOR", "PassCosts", "calibrate", "is_measured", "pass_costs", "prior_cost"]

DRAFT_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 31)  # each small k measured: the 1 -> 2 step can jump
CONTEXT = 256  # tokens already in the cache when a calibration pass runs
REPEATS = 3
MAX_SPREAD = 0.25  # (max - min) / median of the one-token pass's repeats above this: a busy machine
CALIBRATE_ENV = "SPECDEC_CALIBRATE"  # "0": use PRIOR, measure nothing up front
PROGRESS_ENV = "SPECDEC_PROGRESS"  # "0": no progress bar while calibrating

# Cost of a pass over 1 + k tokens / a one-token pass: SmolLM2-135M, fp32, 2 cores of one CPU
# (with the CPU shortcuts). Only a prior: another CPU measured 1.84x at k = 1.
PRIOR = {0: 1.0, 1: 1.06, 2: 1.24, 4: 1.33, 8: 1.69, 16: 2.54, 32: 4.2}

ONLINE_WEIGHT = 0.1  # weight of one new observation in the running average
ONLINE_CLIP = 2.0  # an observation counts as at most this factor away from the current estimate
ONLINE_MIN = 3  # observations of k (and of k = 0) before they replace the calibration


def _interpolate(points: dict[int, float], k: float) -> float:
    """Piecewise-linear through `points` (k -> value), extended linearly past the largest k."""
    keys = sorted(points)
    for k0, k1 in zip(keys, keys[1:], strict=False):
        if k <= k1:
            return points[k0] + (points[k1] - points[k0]) * (k - k0) / (k1 - k0)
    k0, k1 = keys[-2], keys[-1]
    return points[k1] + (points[k1] - points[k0]) * (k - k1) / (k1 - k0)


def prior_cost(num_drafts: int) -> float:
    """Relative cost of verifying `num_drafts` drafts under `PRIOR`."""
    return _interpolate(PRIOR, num_drafts)


@dataclass
class PassCosts:
    """What a pass over 1 + k new tokens costs one model here, and which CPU shortcuts it uses.

    Call it with k for the relative cost (a pass over one token = 1.0): it is the `draft_cost`
    of the speculative methods. `seconds()` gives absolute times (a drafter's step is compared
    with the target's in seconds).
    """

    relative: dict[int, float]  # k -> cost of 1 + k tokens / cost of 1 token, at the measured k
    one_token_seconds: float | None  # the one-token pass, None when unmeasured (prior)
    shortcuts: dict[int, Shortcuts] = field(default_factory=dict)  # measured k -> fastest choice
    measured: bool = False
    _online: dict[int, list[float]] = field(default_factory=dict, repr=False)  # k -> [seconds, count]

    def __call__(self, num_drafts: int) -> float:
        online = self._online
        if (
            num_drafts in online and 0 in online
            and online[num_drafts][1] >= ONLINE_MIN and online[0][1] >= ONLINE_MIN
        ):
            return online[num_drafts][0] / online[0][0]
        return _interpolate(self.relative, num_drafts)

    def seconds(self, num_drafts: int = 0) -> float | None:
        """Estimated seconds of a pass over 1 + `num_drafts` tokens (None before any timing)."""
        base = self._online[0][0] if 0 in self._online else self.one_token_seconds
        return None if base is None else base * self(num_drafts)

    def shortcuts_for(self, num_drafts: int) -> Shortcuts:
        """The CPU shortcuts to use for a pass over 1 + `num_drafts` tokens: those measured fastest
        at the nearest measured k below (none when nothing was measured)."""
        below = [k for k in self.shortcuts if k <= num_drafts]
        return self.shortcuts[max(below)] if below else Shortcuts()

    def observe(self, num_drafts: int, seconds: float) -> None:
        """A pass over 1 + `num_drafts` tokens took `seconds`: refine the running estimate."""
        entry = self._online.get(num_drafts)
        if entry is None:
            self._online[num_drafts] = [seconds, 1]
            return
        estimate = entry[0]
        clipped = min(max(seconds, estimate / ONLINE_CLIP), estimate * ONLINE_CLIP)
        entry[0] = estimate + ONLINE_WEIGHT * (clipped - estimate)
        entry[1] += 1

    def table(self) -> dict[int, float]:
        """The relative costs it uses now, at 0 and the measured k (for reports)."""
        return {k: round(self(k), 3) for k in (0, *DRAFT_SIZES)}

    def to_json(self) -> dict:
        return {"relative": self.relative, "one_token_seconds": self.one_token_seconds, "measured": self.measured,
                "shortcuts": {k: [s.few_row_linear, s.gqa_without_repeat] for k, s in self.shortcuts.items()}}

    @classmethod
    def from_json(cls, data: dict) -> PassCosts:
        return cls(
            relative={int(k): v for k, v in data["relative"].items()},
            one_token_seconds=data["one_token_seconds"],
            shortcuts={int(k): Shortcuts(*v) for k, v in data["shortcuts"].items()},
            measured=data["measured"],
        )


def prior_costs() -> PassCosts:
    return PassCosts(relative=dict(PRIOR), one_token_seconds=None)


# Calibration -----------------------------------------------------------------------------------


def time_passes(model: PreTrainedModel, choices: list[Shortcuts], repeats: int) -> dict[tuple[int, Shortcuts], list[float]]:
    """Seconds of each (k, shortcuts) pass, `repeats` times each, interleaved."""
    from utils.caching import ModelRunner, context_length, is_encoder_decoder, synchronize, vocab_size

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
    progress = tqdm(total=(repeats + 1) * len(plan), desc=f"Measuring {type(model).__name__}'s pass costs here (once, cached)",
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
    from utils.caching import input_device

    device = input_device(model)
    parameter = next(model.parameters())
    kernels = hashlib.sha256(Path(cpu_passes.__file__).read_bytes() + Path(__file__).read_bytes()).hexdigest()[:12]
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
    from utils.loading import cache_dir

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
