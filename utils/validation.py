"""Checks of user input, run before any model does: each raises a ValueError or TypeError that names
the argument, the value and what was expected (STYLE.md, principle 7)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
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


# What every decoding function takes as `inputs` (INPUTS_DOC says how each form is read).
Inputs = list[int] | list[list[int]] | torch.Tensor | Mapping[str, object]

INPUTS_DOC = """`inputs`: one sequence, a list of token ids or a 1-D tensor; or a batch, a list of token-id
lists (rows of any lengths) or a 2-D tensor; or a tokenizer's output (`BatchEncoding`, or a dict)
with `input_ids` of either shape and, when present, an `attention_mask` of the same shape, whose
zeros (padding, left or right) are removed from each row before decoding. The result follows the
shape: one result for one sequence, a list with one per row for a batch, so that
`tokenizer(text, return_tensors="pt")` ([1, n]) is a batch of one and gives a list of one."""


def _is_tensor(value: object) -> bool:
    """A torch tensor or a NumPy array (anything with `tolist` and `ndim`), not a Python list."""
    return hasattr(value, "tolist") and hasattr(value, "ndim") and not isinstance(value, (list, tuple))


def is_batch(value: object) -> bool:
    """Whether `inputs` is a batch: a 2-D tensor, a list (or tuple) whose first item is itself a
    sequence, or a mapping whose `input_ids` is one of these."""
    if isinstance(value, Mapping):
        value = value.get("input_ids")
    if _is_tensor(value):
        return value.ndim == 2
    return (isinstance(value, (list, tuple)) and len(value) > 0 and not isinstance(value[0], (str, bytes))
            and (isinstance(value[0], Sequence) or hasattr(value[0], "tolist")))


def _as_rows(value: object, name: str) -> tuple[list, bool]:
    """A tensor or nested list -> (its rows as lists, whether it was a batch); one sequence is one row."""
    if _is_tensor(value):
        if value.ndim not in (1, 2):
            raise ValueError(f"{name} must be a 1-D tensor (one sequence) or a 2-D tensor (a batch), "
                             f"got shape {tuple(value.shape)}")
        if value.ndim == 2 and value.shape[0] == 0:
            raise ValueError(f"{name} must hold at least one row, got a tensor of shape {tuple(value.shape)}")
        rows = value.tolist()
        return (rows, True) if value.ndim == 2 else ([rows], False)
    if isinstance(value, (list, tuple)) and len(value) == 0:
        raise ValueError(f"{name} must hold at least one token id (or, for a batch, one row), got an empty list")
    if is_batch(value):
        return [row.tolist() if _is_tensor(row) else row for row in value], True
    return [value], False


def _lengths(rows: list) -> list[int | None]:
    return [len(row) if isinstance(row, Sequence) else None for row in rows]


def _unpad(rows: list, mask: object, batched: bool, name: str) -> list:
    """Each row without the positions its attention-mask row holds 0 at (padding at either end)."""
    where = f"{name}['attention_mask']"
    masks, mask_batched = _as_rows(mask, where)
    if mask_batched != batched or _lengths(masks) != _lengths(rows):
        ids = f"{len(rows)} row(s) of {_lengths(rows)} tokens" if batched else f"{_lengths(rows)[0]} tokens"
        raise ValueError(f"{where} must have the shape of {name}['input_ids'] ({ids}), got {_short(mask)}")
    kept = []
    for i, (row, row_mask) in enumerate(zip(rows, masks, strict=True)):
        label = f"{where}[{i}]" if batched else where
        if any(m not in (0, 1) for m in row_mask):
            raise ValueError(f"{label} must hold only 0 (padding) and 1 (a token), got {_short(row_mask)}")
        ones = [j for j, m in enumerate(row_mask) if m]
        if not ones:
            raise ValueError(f"{label} is all zeros: that row has no token to decode")
        if len(ones) != ones[-1] - ones[0] + 1:
            hole = next(j for j in range(ones[0], ones[-1]) if not row_mask[j])
            raise ValueError(f"{label} has a 0 at position {hole}, between tokens: only padding at the left or "
                             "the right of a row can be removed")
        kept.append(row[ones[0] : ones[-1] + 1])
    return kept


def check_batch(value: object, name: str, model: PreTrainedModel) -> tuple[list[list[int]], bool]:
    """`inputs` in any accepted form (`INPUTS_DOC`) -> (rows of token ids, whether it was a batch).
    The one place where inputs are normalised: tensors become lists, padding is removed by the
    attention mask. Errors name the row: an empty batch, an empty row, a row that is not token ids,
    a token outside the vocabulary, an attention mask of another shape or with a hole."""
    mask = None
    if isinstance(value, Mapping):  # a BatchEncoding (tokenizer output) or a dict
        if "input_ids" not in value:
            raise ValueError(f"{name} is a mapping without 'input_ids' (keys {sorted(map(str, value))}): pass a "
                             "tokenizer's output, a dict with input_ids, or the token ids themselves")
        value, mask = value["input_ids"], value.get("attention_mask")
        ids_name = f"{name}['input_ids']"
    else:
        ids_name = name
    rows, batched = _as_rows(value, ids_name)
    if mask is not None:
        rows = _unpad(rows, mask, batched, name)
    return [check_token_ids(row, f"{ids_name}[{i}]" if batched else ids_name, model) for i, row in enumerate(rows)], batched


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
