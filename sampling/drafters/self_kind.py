"""The self-drafter's kind: the target drafts for itself, its own weights in 4 or 8 bits
(`sampling/drafters/self_drafting.py`). `speculative_generate(inputs, "self", target)` builds it once per target,
bits and group size; a model from `quantized_drafter(target)` is taken as it is. Its options are a drafter model's
(`ModelOptions`: it drafts as one) and its own: `bits`, `group_size`, and `share_cache` (draft over the target's
cache, no prompt pass of its own, where the target's runner allows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sampling.drafters.model_kind import ModelOptions, build_model_drafter, check_model_drafter
from sampling.drafters.registry import register_kind
from sampling.drafters.self_drafting import self_drafter, self_drafting
from sampling.loop.common import Generation, Request
from sampling.loop.options import DecodingOptions, Drafting
from utils.quantize import BITS
from utils.quantized_models import GROUP_SIZES, check_quantization, drafter_group
from utils.validation import check_bool

SELF = "self"  # the drafter argument that asks for the self-drafter
DEFAULT_BITS = 4  # `bits` left out for "self": a quarter of the weights' bytes (4.5 bits a weight with its scales)


@dataclass(frozen=True, kw_only=True)
class SelfOptions(ModelOptions):
    """A drafter model's options (but `drafter_tokenizer`: the target's own tokenizer serves) and the self-drafter's.
    `bits`: 4, 8 or "auto" (`sampling.drafters.self_bits`); None: 4 for "self", a `quantized_drafter`'s own.
    `group_size`: the int4 groups (None: `utils.quantized_models.drafter_group`'s choice, or a model's own)."""

    bits: int | str | None = None
    group_size: int | None = None
    share_cache: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.drafter_tokenizer is not None:
            raise ValueError("drafter_tokenizer: the self-drafter is the target's own model and drafts in its vocabulary;"
                             " leave drafter_tokenizer out")
        if self.bits is not None and (isinstance(self.bits, bool) or self.bits not in (*BITS, "auto")):
            raise ValueError(f"bits must be 4, 8 or 'auto' (None: {DEFAULT_BITS}), got {self.bits!r}")
        if self.group_size is not None and (isinstance(self.group_size, bool) or self.group_size not in GROUP_SIZES):
            raise ValueError(f"group_size must be one of {GROUP_SIZES} or None, got {self.group_size!r}")
        check_bool(self.share_cache, "share_cache")


def check_built(drafter: object, options: SelfOptions) -> None:
    """A `quantized_drafter` model passed whole: `bits` and `group_size`, where asked, must be what it was built with."""
    info = self_drafting(drafter)
    for name, asked, built in (("bits", options.bits, info.bits), ("group_size", options.group_size, info.group_size)):
        if asked is not None and asked != built:
            raise ValueError(f"{name}={asked!r}, but the drafter is a quantized_drafter built with {name}={built}: "
                             f'pass "self" as the drafter to have it built so, or leave {name} out')


class SelfDrafterKind:
    """The target drafting for itself in fewer bits (`speculative_generate(inputs, "self", target)`)."""

    Options = SelfOptions
    what = 'the string "self" (the target drafting for itself in 4 or 8 bits)'

    def takes(self, drafter: object, given: dict[str, object]) -> bool:
        if given.get("ngram") is not None:  # beside a pool: the hybrid kind's
            return False
        return drafter == SELF if isinstance(drafter, str) else self_drafting(drafter) is not None

    def check(self, request: Request, shared: DecodingOptions, drafter: object,
              options: SelfOptions) -> Callable[[Generation], Drafting]:
        target = request.model
        if isinstance(drafter, str):
            if request.encoder_decoder:
                raise ValueError('drafter="self" drafts for decoder-only targets (the target is an encoder-decoder model)')
            bits = DEFAULT_BITS if options.bits in (None, "auto") else options.bits
            check_quantization(target, bits, options.group_size or drafter_group(target))
        else:
            check_built(drafter, options)
            check_model_drafter(request, shared, drafter, options)

        def build(gen: Generation) -> Drafting:
            model = drafter if not isinstance(drafter, str) else self_drafter(
                target, options.bits or DEFAULT_BITS, options.group_size)
            model_drafter, _, policy = build_model_drafter(model, target, gen, shared, options, universal=False,
                                                           share_cache=options.share_cache)
            return Drafting(model_drafter, shared.draft_policy or policy, model_drafter.counters)

        return build


register_kind(SelfDrafterKind())
