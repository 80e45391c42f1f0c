"""Ngram Assisted Speculative Decoding (NASD): speculative decoding with an n-gram pool as drafter."""

from ngram_assisted.drafter import NgramDrafter
from ngram_assisted.dynagram import DynaGram, MultiDynaGram, Prediction, SimpleDynaGram
from ngram_assisted.nasd import (
    ngram_assisted_speculative_generate,
    ngram_assisted_speculative_generate_encoder_decoder,
)
from ngram_assisted.options import NgramOptions

__all__ = [
    "DynaGram",
    "MultiDynaGram",
    "NgramDrafter",
    "NgramOptions",
    "Prediction",
    "SimpleDynaGram",
    "ngram_assisted_speculative_generate",
    "ngram_assisted_speculative_generate_encoder_decoder",
]
