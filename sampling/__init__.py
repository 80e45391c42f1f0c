"""Decoding methods over Hugging Face models: autoregressive, beam search, speculative."""

from sampling.autoregressive import autoregressive_generate, autoregressive_generate_encoder_decoder
from sampling.common import Step
from sampling.speculative import (
    SpeculativeStats,
    speculative_generate,
    speculative_generate_encoder_decoder,
)

__all__ = [
    "Step",
    "SpeculativeStats",
    "autoregressive_generate",
    "autoregressive_generate_encoder_decoder",
    "speculative_generate",
    "speculative_generate_encoder_decoder",
]
