"""Checks of user input, run before any model does: each raises a ValueError or TypeError that names
the argument, the value and what was expected (STYLE.md, principle 7)."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedModel

from utils.caching import context_length, is_encoder_decoder, vocab_size
from utils.logits_processors import LogitsProcessor


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_int(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {_short(value)}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return value


def check_token_ids(value: object, name: str, model: PreTrainedModel) -> list[int]:
    """A non-empty list of ints, each a valid index into the model's vocabulary."""
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        value = value.tolist()  # a 1-D tensor or array is accepted too
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be a list of token ids (ints), got {_short(value)}")
    if len(value) == 0:
        raise ValueError(f"{name} must hold at least one token id, got an empty list")
    vocab = vocab_size(model)
    for token in value:
        if isinstance(token, bool) or not isinstance(token, int):
            raise TypeError(f"{name} must be a list of token ids (ints), found {_short(token)}")
        if not 0 <= token < vocab:
            raise ValueError(f"{name} holds token id {token}, outside the model's vocabulary [0, {vocab})")
    return list(value)


def is_batch(value: object) -> bool:
    """Whether `inputs` is a batch: a list (or tuple) whose first item is itself a sequence."""
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        return getattr(value, "ndim", 1) == 2
    return (isinstance(value, (list, tuple)) and len(value) > 0 and not isinstance(value[0], (str, bytes))
            and (isinstance(value[0], Sequence) or hasattr(value[0], "tolist")))


def check_batch(value: object, name: str, model: PreTrainedModel) -> tuple[list[list[int]], bool]:
    """One sequence of token ids, or a batch (a list of them) -> (rows, whether it was a batch).
    Errors name the row: an empty batch, an empty row, a row that is not token ids, a token outside
    the vocabulary."""
    if isinstance(value, (list, tuple)) and len(value) == 0:
        raise ValueError(f"{name} must hold at least one token id (or, for a batch, one row), got an empty list")
    if not is_batch(value):
        return [check_token_ids(value, name, model)], False
    rows = value.tolist() if hasattr(value, "tolist") and not isinstance(value, (list, tuple)) else list(value)
    return [check_token_ids(row, f"{name}[{i}]", model) for i, row in enumerate(rows)], True


def check_rows_argument(value: object, name: str, rows: int, kind: type | tuple[type, ...]) -> list:
    """A per-row argument: one value for every row, or a list of `rows` values -> a list per row."""
    if isinstance(value, (list, tuple)):
        if len(value) != rows:
            raise ValueError(f"{name} is a list of {len(value)} items, but the batch has {rows} rows: give one per row")
        for i, item in enumerate(value):
            if not isinstance(item, kind):
                raise TypeError(f"{name}[{i}] must be a {getattr(kind, '__name__', kind)}, got {_short(item)}")
        return list(value)
    return [value] * rows


def check_end_tokens(value: object, model: PreTrainedModel) -> frozenset[int]:
    """`end_tokens_id`: None, an int, or a list of ints -> the set of end tokens."""
    if value is None:
        return frozenset()
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple, set, frozenset)):
        raise TypeError(f"end_tokens_id must be None, an int or a list of ints, got {_short(value)}")
    tokens = []
    vocab = vocab_size(model)
    for token in value:
        if isinstance(token, bool) or not isinstance(token, int):
            raise TypeError(f"end_tokens_id must be None, an int or a list of ints, found {_short(token)}")
        if not 0 <= token < vocab:
            raise ValueError(f"end_tokens_id holds {token}, outside the model's vocabulary [0, {vocab})")
        tokens.append(token)
    return frozenset(tokens)


def check_model(model: object, name: str, encoder_decoder: bool) -> PreTrainedModel:
    """A Hugging Face model of the expected kind (decoder-only or encoder-decoder)."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"{name} must be a transformers PreTrainedModel, got {type(model).__name__}")
    if is_encoder_decoder(model) and not encoder_decoder:
        raise ValueError(
            f"{name} is an encoder-decoder model ({type(model).__name__}): "
            "use the *_encoder_decoder variant of this function"
        )
    if encoder_decoder and not is_encoder_decoder(model):
        raise ValueError(
            f"{name} is a decoder-only model ({type(model).__name__}): "
            "use the variant of this function without _encoder_decoder"
        )
    return model


def check_processor(value: object) -> LogitsProcessor:
    if not isinstance(value, LogitsProcessor):
        hint = ""
        if type(value).__module__.startswith("transformers") or isinstance(value, list):
            hint = "; wrap transformers' processors as TransformersProcessor(processors, do_sample=...)"
        raise TypeError(
            f"logits_processor must be a LogitsProcessor (e.g. GreedyProcessor()), got {_short(value)}{hint}"
        )
    return value


def check_fits(length: int, model: PreTrainedModel, name: str) -> None:
    """The prompt must leave room for at least one generated token in the model's context."""
    limit = context_length(model)
    if limit is not None and length >= limit:
        raise ValueError(
            f"{name} has {length} tokens, but the model's context holds {limit}: "
            f"shorten it to at most {limit - 1} tokens"
        )


def check_decoder_start(model: PreTrainedModel) -> int:
    start = getattr(model.generation_config, "decoder_start_token_id", None)
    if start is None:
        start = getattr(model.config, "decoder_start_token_id", None)
    if not isinstance(start, int):
        raise ValueError(
            f"{type(model).__name__} has no decoder_start_token_id in its config; set "
            "model.config.decoder_start_token_id (an int) before generating"
        )
    return start
