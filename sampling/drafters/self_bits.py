"""`quantized_drafter(target, bits="auto")`: 4 or 8 bits, by what each costs and how often it agrees
with the target, measured once per model and machine and kept under `SPECDEC_CACHE`.

The rule (Leviathan et al. 2023, eq. 1 and the walltime improvement of their Theorem 3.8): for each
width b, c_b is the drafter's one-token pass over the target's (the median of `REPEATS` passes each,
after a warm-up, at `CONTEXT` tokens of context) and a_b the rate at which the drafter's greedy token
equals the target's along the target's own greedy text (`TEXT` tokens, teacher-forced); the
expected speed-up of chains of `GAMMA` drafts is (1 - a^(GAMMA+1)) / ((1 - a) (GAMMA c + 1)), and
the larger one wins (4 bits on a tie: fewer bytes).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PreTrainedModel

from utils.machine import machine
from utils.paths import cache_dir, write_cached
from utils.quantized_models import quantized_state_key
from utils.runners.model_info import vocab_size
from utils.runners.sequence import SequenceRunner

GAMMA = 5  # the draft length the rule prices
CONTEXT = 64  # tokens of context of the timed passes
TEXT = 48  # target-greedy tokens the agreement is read on
REPEATS = 5  # timed one-token passes per model


def expected_speedup(agreement: float, cost: float, gamma: int = GAMMA) -> float:
    """Tokens per unit of target time with chains of `gamma` drafts at per-token agreement
    `agreement` and a drafter pass costing `cost` target passes (Leviathan et al. 2023)."""
    tokens = gamma + 1 if agreement >= 1 else (1 - agreement ** (gamma + 1)) / (1 - agreement)
    return tokens / (gamma * cost + 1)


@torch.no_grad()
def _target_text(target: PreTrainedModel) -> list[int]:
    """A fixed prompt and the target's greedy continuation of it (`TEXT` tokens)."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, min(vocab_size(target), 10_000), (CONTEXT,), generator=generator).tolist()
    runner = SequenceRunner(target)
    logits = runner.forward(tokens)
    for _ in range(TEXT):
        tokens.append(int(logits[-1].argmax()))
        logits = runner.forward([tokens[-1]])
    return tokens


@torch.no_grad()
def _one_token_seconds(model: PreTrainedModel, tokens: list[int]) -> float:
    runner = SequenceRunner(model)
    runner.forward(tokens[:CONTEXT])
    times = []
    for i in range(REPEATS + 1):  # the first pass warms up and is not kept
        start = time.perf_counter()
        runner.forward([tokens[CONTEXT + i]])
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


@torch.no_grad()
def _agreement(drafter: PreTrainedModel, target: PreTrainedModel, tokens: list[int]) -> float:
    ids = torch.tensor([tokens], device=next(target.parameters()).device)
    theirs = target(input_ids=ids).logits[0, CONTEXT - 1 : -1].argmax(-1)
    ours = drafter(input_ids=ids).logits[0, CONTEXT - 1 : -1].argmax(-1)
    return float((theirs == ours).float().mean())


def measure(target: PreTrainedModel, build: Callable[[int], PreTrainedModel]) -> dict[int, dict[str, float]]:
    """Per width (4, 8): the drafter's one-token pass cost over the target's and its agreement."""
    tokens = _target_text(target)
    target_seconds = _one_token_seconds(target, tokens)
    figures = {}
    for bits in (4, 8):
        drafter = build(bits)
        figures[bits] = {"cost": _one_token_seconds(drafter, tokens) / target_seconds,
                         "agreement": _agreement(drafter, target, tokens)}
    return figures


def choose_bits(target: PreTrainedModel, group_size: int, build: Callable[[int], PreTrainedModel]) -> int:
    """4 or 8 for `quantized_drafter(target, "auto", group_size)` (module docstring); `build(bits)`
    makes the drafter of that width. Measured once, then read from the cache."""
    where = (f"{quantized_state_key(target, 0, group_size)}{machine()['cpu']}{torch.get_num_threads()}"
             f"{hashlib.sha256(Path(__file__).read_bytes()).hexdigest()}")  # this file's measurement too
    path = cache_dir() / "self_bits" / f"{hashlib.sha256(where.encode()).hexdigest()[:24]}.json"
    figures = _stored(path)
    if figures is None:
        figures = measure(target, build)
        write_cached(path, lambda file: file.write_text(json.dumps(figures, indent=1)))
    speedups = {bits: expected_speedup(f["agreement"], f["cost"]) for bits, f in figures.items()}
    return 4 if speedups[4] >= speedups[8] else 8


def _stored(path: Path) -> dict[int, dict[str, float]] | None:
    """The figures stored at `path`, None where there are none (or none readable: measured again)."""
    try:
        figures = {int(bits): value for bits, value in json.loads(path.read_text()).items()}
        return figures if all(0 <= figures[b]["agreement"] <= 1 and figures[b]["cost"] > 0 for b in (4, 8)) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
