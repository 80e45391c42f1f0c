"""The model says its kind: the public functions' encoder-decoder names are thin names over the
decoder-only functions.

Each public decoding function runs for the kind of model it is given (`is_encoder_decoder`); its
name promises one kind, checked before anything else (`check_model`: a ValueError that names the
other name). `encoder_decoder_twin` makes the `*_encoder_decoder` name of a function: the same
body, signature and checks, for encoder-decoder models, with its own docstring.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from utils.validation import check_model, transformers_names


def of_kind(encoder_decoder: bool, model_argument: str) -> Callable[[Callable], Callable]:
    """A public function's promise: its `model_argument` is a model of this kind (encoder-decoder
    or decoder-only), checked before the function runs."""

    def decorate(function: Callable) -> Callable:
        signature = inspect.signature(function)

        @functools.wraps(function)
        def checked(*args, **kwargs):
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:  # a call Python refuses: its own error, unchanged
                return function(*args, **kwargs)
            if model_argument in bound.arguments:
                check_model(bound.arguments[model_argument], model_argument, encoder_decoder)
            return function(*args, **kwargs)

        return checked

    return decorate


def encoder_decoder_twin(public: Callable, name: str, doc: str, model_argument: str) -> Callable:
    """The `*_encoder_decoder` name of the decoder-only public function `public`."""
    twin = of_kind(True, model_argument)(inspect.unwrap(public))
    twin.__name__ = twin.__qualname__ = name
    twin.__doc__ = doc
    return transformers_names(twin)
