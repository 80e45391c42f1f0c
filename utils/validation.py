"""Checks of user input, run before any model does: each raises a ValueError or TypeError that names
the argument, the value and what was expected (STYLE.md, principle 7)."""

from __future__ import annotations

import enum
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence

import torch
from transformers import PreTrainedModel

from utils.logits_processors import LogitsProcessor
from utils.runners.model_info import context_length, is_encoder_decoder, vocab_size

# transformers' `generate` arguments a user types by habit -> what this library calls them.
TRANSFORMERS_NAMES = {
    "max_new_tokens": "max_gen_len",
    "max_length": "max_gen_len (it counts new tokens only)",
    "min_new_tokens": "end_tokens_id=None (no end token: it generates max_gen_len tokens)",
    "input_ids": "inputs (the first argument: token ids, a tensor, or the tokenizer's whole output)",
    "attention_mask": "inputs (pass the tokenizer's whole output: its attention_mask comes with it)",
    "eos_token_id": "end_tokens_id",
    "do_sample": "logits_processor (GreedyProcessor() for greedy, e.g. MultinomialProcessor() to sample)",
    "temperature": "logits_processor (e.g. MultinomialProcessor(temperature=0.7))",
    "top_k": "logits_processor (e.g. TopKProcessor(temperature=1.0, top_k=50))",
    "top_p": "logits_processor (e.g. NucleusProcessor(temperature=1.0, top_p=0.9))",
    "repetition_penalty": "logits_processor (e.g. TransformersProcessor([RepetitionPenaltyLogitsProcessor(1.2)], "
                          "do_sample=False))",
    "num_beams": "beam_search_generate(inputs, model, num_beams=...)",
    "length_penalty": "length_penalty of beam_search_generate (the GNMT length penalty's exponent, >= 0); the "
                      "other functions have no length penalty",
    "early_stopping": "nothing: beam_search_generate stops when no live beam can beat the best finished one",
    "no_repeat_ngram_size": "logits_processor (e.g. TransformersProcessor([NoRepeatNGramLogitsProcessor(3)], "
                            "do_sample=False))",
    "bad_words_ids": "logits_processor (TransformersProcessor([NoBadWordsLogitsProcessor(...)], do_sample=...))",
    "min_length": "logits_processor (TransformersProcessor([MinLengthLogitsProcessor(...)], do_sample=...))",
    "generation_config": "logits_processor=TransformersProcessor.from_generation_config(config), with "
                         "max_gen_len and end_tokens_id from it",
    "output_scores": "stats=SpeculativeStats(): its logprobs hold each returned token's log-probability "
                     "(every function but beam_search_generate, which returns ids only)",
    "output_logits": "stats=SpeculativeStats(): its logprobs hold each returned token's log-probability "
                     "(every function but beam_search_generate, which returns ids only)",
    "return_dict_in_generate": "stats=SpeculativeStats() (the ids come back as lists, the numbers in stats; "
                               "every function but beam_search_generate)",
    "num_beam_groups": "nothing: diverse beam search is not offered",
    "diversity_penalty": "nothing: diverse beam search is not offered",
    "assistant_model": "drafter (speculative_generate(inputs, drafter, target))",
    "assistant_tokenizer": "drafter_tokenizer (with tokenizer=, the target's)",
    "num_assistant_tokens": "gamma",
    "prompt_lookup_num_tokens": "ngram_assisted_speculative_generate (n-gram drafting), with gamma",
    "streamer": "on_step (a function that receives each Step)",
    "seed": "generator (a torch.Generator, e.g. torch.Generator().manual_seed(0))",
}


def transformers_names(function: Callable) -> Callable:
    """Refuse transformers' `generate` arguments that this function does not take (`max_new_tokens`,
    `do_sample`, ...) with a TypeError that says what this library calls them; every other call
    goes through unchanged (Python's own TypeError for any other unknown name)."""
    own = set(inspect.signature(function).parameters)

    @functools.wraps(function)
    def checked(*args, **kwargs):
        for key in kwargs:
            if key in TRANSFORMERS_NAMES and key not in own:
                raise TypeError(f"{function.__name__}() got {key}=, transformers' name: this library calls it "
                                f"{TRANSFORMERS_NAMES[key]}")
        return function(*args, **kwargs)

    return checked


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_int(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {_short(value)}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return value


def check_bool(value: object, name: str, optional: bool = False) -> None:
    """A bool (`optional`: or None), else a TypeError naming `name`."""
    if isinstance(value, bool) or (optional and value is None):
        return
    raise TypeError(f"{name} must be a bool{' or None' if optional else ''}, got {_short(value)}")


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
zeros (padding, left or right) are removed from each row before decoding. A batch without a mask
is stripped of `pad_token_id` at both ends of each row when it is given; without it, a batch of
equal rows that looks padded (the model's pad or end token at a row's end or start, where another
row has none, or twice) is refused, never decoded as text. The result follows the
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


def _pad_candidates(model: PreTrainedModel) -> tuple[set[int], set[int]]:
    """(tokens that only pad: the model's pad token where it is neither its BOS nor an EOS, tokens
    a tokenizer may pad with: that pad token and the EOS tokens, GPT-2's habit)."""
    found: dict[str, set[int]] = {"pad_token_id": set(), "eos_token_id": set(), "bos_token_id": set()}
    for config in (model.config, getattr(model, "generation_config", None)):
        for key, ids in found.items():
            value = getattr(config, key, None)
            for token in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(token, int) and not isinstance(token, bool):
                    ids.add(token)
    pure = found["pad_token_id"] - found["eos_token_id"] - found["bos_token_id"]
    return pure, found["pad_token_id"] | found["eos_token_id"]


def _run(row: list, token: int, from_end: bool) -> int:
    """How many `token`s the row begins (or ends) with."""
    n = 0
    for t in reversed(row) if from_end else row:
        if t != token:
            break
        n += 1
    return n


def _refuse_padding(rows: list, name: str, model: PreTrainedModel) -> None:
    """A rectangular batch without a mask whose rows look padded -> ValueError (never decoded as
    text). Padding to the longest row leaves that row unpadded, so the evidence is: some rows begin
    (or end) with a token a tokenizer pads with and others do not, or a row has two or more of them
    there, or a row begins or ends with a token that only pads (the model's pad token, when it is
    neither BOS nor EOS). Rows of different lengths were not padded: they pass."""
    if len({len(row) for row in rows}) != 1:
        return
    pure, candidates = _pad_candidates(model)
    for token in sorted(candidates):
        for from_end, side in ((True, "ends"), (False, "begins")):
            runs = [_run(row, token, from_end) for row in rows]
            padded = [i for i, n in enumerate(runs) if n]
            if not padded or (token not in pure and len(padded) == len(rows) and max(runs) < 2):
                continue
            i = padded[0]
            raise ValueError(
                f"{name} is a batch without an attention mask, and its row {i} {side} with {runs[i]} x token "
                f"{token} (the model's pad or end token): it looks padded, and padding decoded as text gives "
                f"garbage. Pass the tokenizer's whole output (input_ids with attention_mask), or "
                f"pad_token_id={token} to strip it from both ends of each row, or the rows unpadded as lists"
            )


def _strip(rows: list, pad_token_id: int, name: str) -> list:
    """Each row without the `pad_token_id`s at its two ends."""
    kept = []
    for i, row in enumerate(rows):
        start, end = _run(row, pad_token_id, False), len(row) - _run(row, pad_token_id, True)
        if start >= end:
            raise ValueError(f"{name}[{i}] is all padding (pad_token_id={pad_token_id}): that row has no token to decode")
        kept.append(row[start:end])
    return kept


def check_batch(value: object, name: str, model: PreTrainedModel,
                pad_token_id: int | None = None) -> tuple[list[list[int]], bool]:
    """`inputs` in any accepted form (`INPUTS_DOC`) -> (rows of token ids, whether it was a batch).
    The one place where inputs are normalised: tensors become lists, padding is removed by the
    attention mask, or, for a batch without one, by `pad_token_id` (from both ends of each row);
    a batch without either whose rows look padded is refused (`_refuse_padding`). Errors name the
    row: an empty batch, an empty row, a row that is not token ids, a token outside the vocabulary,
    an attention mask of another shape or with a hole, a row that is all padding."""
    if pad_token_id is not None and (isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int)):
        raise TypeError(f"pad_token_id must be an int (the token padded rows are filled with) or None, "
                        f"got {_short(pad_token_id)}")
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
    elif batched and all(isinstance(row, Sequence) for row in rows):
        if pad_token_id is not None:
            rows = _strip(rows, pad_token_id, ids_name)
        else:
            _refuse_padding(rows, ids_name, model)
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


class _Default(enum.Enum):
    """Defaults that stand for something the model says."""

    MODEL_EOS = "the model's generation_config.eos_token_id"

    def __repr__(self) -> str:
        return self.name


# `end_tokens_id` left out: the model's `generation_config.eos_token_id` (all of them, when a list), as
# transformers' `generate` does; an explicit None means that only max_gen_len stops.
MODEL_EOS = _Default.MODEL_EOS


def model_end_tokens(model: PreTrainedModel) -> frozenset[int]:
    """The end tokens of the model's generation config (its `eos_token_id`, an int or a list), those in its vocabulary."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = eos if isinstance(eos, (list, tuple)) else [eos]
    vocab = vocab_size(model)
    return frozenset(t for t in ids if isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab)


def check_end_tokens_form(value: object) -> None:
    """`end_tokens_id`'s form, before any model is known: `MODEL_EOS`, None, an int or a list of ints."""
    if value is MODEL_EOS or value is None:
        return
    values = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(values, (list, tuple, set, frozenset)):
        raise TypeError(f"end_tokens_id must be None, an int or a list of ints, got {_short(value)}")
    for token in values:
        if isinstance(token, bool) or not isinstance(token, int):
            raise TypeError(f"end_tokens_id must be None, an int or a list of ints, found {_short(token)}")


def check_end_tokens(value: object, model: PreTrainedModel) -> frozenset[int]:
    """`end_tokens_id` (its form checked already, `check_end_tokens_form`): None, an int, or a list of
    ints, each in the model's vocabulary -> the set of end tokens; `MODEL_EOS` (left out): the model's
    own (`model_end_tokens`)."""
    if value is MODEL_EOS:
        return model_end_tokens(model)
    tokens = []
    vocab = vocab_size(model)
    for token in [] if value is None else [value] if isinstance(value, int) else value:
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
