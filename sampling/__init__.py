"""Decoding methods over Hugging Face models: autoregressive, beam search, speculative."""

from sampling.autoregressive import autoregressive_generate, autoregressive_generate_encoder_decoder
from sampling.beam_search import beam_search_generate
from sampling.drafters.self_drafting import quantized_drafter
from sampling.loop.common import Step
from sampling.loop.drafts import Draft, Drafter, DraftTree
from sampling.policy.draft_policy import DraftPolicy
from sampling.speculative import (
    SpeculativeStats,
    speculative_generate,
    speculative_generate_encoder_decoder,
)
from utils.runners.prompt_cache import PromptCache

__all__ = [
    "Draft",
    "DraftPolicy",
    "DraftTree",
    "Drafter",
    "PromptCache",
    "Step",
    "SpeculativeStats",
    "autoregressive_generate",
    "autoregressive_generate_encoder_decoder",
    "beam_search_generate",
    "quantized_drafter",
    "speculative_generate",
    "speculative_generate_encoder_decoder",
]
