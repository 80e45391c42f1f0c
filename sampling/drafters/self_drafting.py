"""The target drafts for itself: `quantized_drafter(target)` is a drafter model built from the
target's own weights, every linear (the output head included) in 4 or 8 bits (`utils/quantize.py`),
the input embedding, the norms and the biases the target's very tensors (shared, not copied; a head
tied to the embedding gets its own quantized copy). Being the same model it agrees with the target
far more often than a smaller model does, at the cost of its weights' bytes (a quarter with 4 bits).

It is a drafter kind of its own (`sampling/drafters/self_kind.py`): `speculative_generate(inputs, "self", target)`
builds it once per target, bits and group (`self_drafter`). By default it makes no prompt pass of its own: where
the target's runner allows it (`utils.runners.shared_cache.can_share`), its passes run over the target's cache,
reading the target's keys and values for the verified prefix and writing its own only for its drafts, which the
target's verification overwrites (`SharedCacheRunner`). The call's `share_cache=False`: the plain design, its
own cache filled by a prompt pass through its own weights. Either way the full-precision target
verifies: greedy output is plain greedy decoding's, token for token, and sampling follows the
target's law with q the quantized model's processed distribution.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from itertools import chain

from transformers import PreTrainedModel

from sampling.drafters.self_bits import choose_bits
from utils.quantized_models import check_quantization, drafter_group, install, quantize_linears
from utils.runners.model_info import is_encoder_decoder
from utils.runners.shared_cache import SharedCacheRunner, can_share
from utils.validation import check_model

__all__ = ["SelfDrafting", "quantized_drafter", "self_drafter", "self_drafting"]

_ATTRIBUTE = "_specdec_self_drafting"
_BUILT = "_specdec_self_drafters"  # on a target: its self-drafters built by `self_drafter`, by (bits, group size)


@dataclass(frozen=True)
class SelfDrafting:
    """What a self-drafter is: whose weights, and in how many bits."""

    target: PreTrainedModel
    bits: int
    group_size: int


def self_drafting(drafter) -> SelfDrafting | None:
    """A `quantized_drafter`'s description, None for any other model."""
    return getattr(drafter, "__dict__", {}).get(_ATTRIBUTE)


def _sharing_copy(target: PreTrainedModel) -> PreTrainedModel:
    """A new module tree over the target's very parameters and buffers (nothing copied but the
    modules, the config and small plain attributes; not the self-drafters built from it)."""
    memo = {id(tensor): tensor for tensor in chain(target.parameters(), target.buffers())}
    built = target.__dict__.get(_BUILT)
    if built is not None:
        memo[id(built)] = {}
    return copy.deepcopy(target, memo)


def quantized_drafter(target: PreTrainedModel, bits: int | str = 4, group_size: int | None = None, *,
                      cache: bool | str = "auto") -> PreTrainedModel:
    """A drafter model from `target`'s own weights (module docstring), for `speculative_generate(inputs,
    quantized_drafter(target), target, ...)` (the same as passing "self" with these `bits` and `group_size`,
    but built anew by each call of this function).

    `bits`: 4 (int4 in groups of `group_size` input columns: our kernel's in groups of 32 or 64, else torch's
    where the output width is a multiple of 16; a layer neither takes is int8) or 8 (int8, one
    scale per output channel), or "auto" (`sampling.drafters.self_bits.choose_bits`: measured once per model
    and machine). `group_size`: 32, 64, 128 or 256, and it must divide some linear's input width; None: 64 where
    our kernel takes every linear so (4.5 bits a weight), else 32 (`utils.quantized_models.drafter_group`).
    `cache`: keep the packed weights under `SPECDEC_CACHE` (True, False, "auto": models of 10M
    parameters and more), so that a later start loads them instead of quantizing again.
    """
    if isinstance(target, PreTrainedModel) and is_encoder_decoder(target):
        raise ValueError(f"target is an encoder-decoder model ({type(target).__name__}): quantized_drafter "
                         "builds drafters for decoder-only targets")
    check_model(target, "target", False)
    group_size = drafter_group(target) if group_size is None else group_size
    check_quantization(target, 4 if bits == "auto" else bits, group_size)
    if bits == "auto":
        bits = choose_bits(target, group_size, lambda b: quantized_drafter(target, b, group_size, cache=cache))
    layers = quantize_linears(target, bits, group_size, cache=cache)
    drafter = _sharing_copy(target)
    install(drafter, layers)
    drafter.config = copy.deepcopy(target.config)
    # Another config means another model to the pass-cost calibration's keys.
    drafter.config.specdec_self_drafter = {"bits": bits, "group_size": group_size}
    drafter.__dict__[_ATTRIBUTE] = SelfDrafting(target, bits, group_size)
    return drafter.eval()


def self_drafter(target: PreTrainedModel, bits: int | str = 4, group_size: int | None = None) -> PreTrainedModel:
    """`quantized_drafter(target, bits, group_size)`, built once per target, bits and group size and kept on the
    target (a notebook's or the console's every call drafts with the same one; `bits="auto"` measured once)."""
    built = target.__dict__.setdefault(_BUILT, {})
    key = (bits, group_size)
    if key not in built:
        built[key] = quantized_drafter(target, bits, group_size)
    return built[key]


def shared_runner(drafter: PreTrainedModel, target: PreTrainedModel, target_runner, *, use_cache: bool,
                  costs, share_cache: bool = True) -> SharedCacheRunner | None:
    """The runner of a self-drafter of `target` that drafts over `target_runner()`'s cache, None where
    it drafts with a cache of its own (not a self-drafter of this target, `share_cache=False`, no
    cache, or a runner whose passes cannot be lent: `can_share`)."""
    info = self_drafting(drafter)
    if info is None or info.target is not target or not share_cache or not use_cache:
        return None
    if not can_share(target_runner(), drafter):
        return None
    return SharedCacheRunner(drafter, target_runner, costs=costs)


class ReleasingDrafter:
    """A drafter over a `SharedCacheRunner`: after each drafting step the target's cache holds only its
    verified tokens again (`SharedCacheRunner.release`). Every other call is the inner drafter's."""

    def __init__(self, inner, runner: SharedCacheRunner) -> None:
        self.inner, self.shared_runner = inner, runner

    def draft(self, sequences, max_drafts, max_depths):
        try:
            return self.inner.draft(sequences, max_drafts, max_depths)
        finally:
            self.shared_runner.release()

    def __getattr__(self, name: str):
        if name == "inner":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)



def releasing(drafter, shared: SharedCacheRunner | None):
    """`drafter` as it drafts over `shared` (a `ReleasingDrafter`), or itself when it has its own cache."""
    return drafter if shared is None else ReleasingDrafter(drafter, shared)
