"""Two tokenizers side by side: which tokens spell the same bytes, and the checks a pair must pass
before a drafter with one tokenizer can draft for a target with another (`sampling/drafters/universal.py`).
Whether each tokenizer is lossless is judged there, on the texts in play, not here on a fixed text:
two tokenizers that lack an emoji's bytes still serve every text without one.

The rule for "the same token" (token-level intersection, Timor et al. 2025): two tokens match iff
they spell the same bytes. A token's bytes come from its vocabulary string: byte-level BPE
(GPT-2, Llama 3, Qwen, SmolLM2: a ByteLevel decoder) writes each byte as one printable character
(`bytes_to_unicode`, so "Ġ" is the space byte), SentencePiece-style vocabularies (Llama 2, Gemma)
write "▁" for a space and "<0xNN>" for a raw byte, anything else is taken as UTF-8 text. Added
tokens (special tokens, chat markers) match only an added token with the same content.
"""

from __future__ import annotations

import functools
import json
import re

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from utils.runners.model_info import vocab_size

PADDING_ROWS = 128  # embedding rows a model may have past its tokenizer (padding), beyond 1%


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's `bytes_to_unicode`, inverted: printable character -> the byte it stands for."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def _is_byte_level(tokenizer: PreTrainedTokenizerBase) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(part.get("type") == "ByteLevel" for part in parts)


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_keys(tokenizer: PreTrainedTokenizerBase, width: int) -> list[object]:
    """One key per token id < min(len(tokenizer), width): its bytes, ("added", content) for an added
    token, None for an id without a string. Equal keys of two tokenizers: the same token (module doc)."""
    added = {token_id: content for content, token_id in tokenizer.get_added_vocab().items()}
    byte_level = _is_byte_level(tokenizer)
    decoder = _byte_decoder()
    strings = tokenizer.convert_ids_to_tokens(list(range(min(len(tokenizer), width))))
    keys: list[object] = []
    for token_id, string in enumerate(strings):
        if token_id in added:
            keys.append(("added", added[token_id]))
        elif string is None:
            keys.append(None)
        elif byte_level:
            keys.append(bytes(decoder[c] for c in string) if all(c in decoder for c in string) else None)
        elif match := _BYTE_TOKEN.fullmatch(string):
            keys.append(bytes([int(match.group(1), 16)]))
        else:
            keys.append(string.replace("▁", " ").encode())
    return keys


def longest_token_bytes(tokenizer: PreTrainedTokenizerBase, width: int) -> int:
    """The most bytes one token id < min(len(tokenizer), width) spells (an added token: its content's): at most
    what one token adds to a text (1 for a vocabulary without strings)."""
    keys = token_keys(tokenizer, width)
    return max((len(key) if isinstance(key, bytes) else len(key[1].encode()) for key in keys if key is not None), default=1)


def intersection(target_tokenizer: PreTrainedTokenizerBase, drafter_tokenizer: PreTrainedTokenizerBase,
                 target_width: int, drafter_width: int) -> tuple[Tensor, Tensor]:
    """The tokens both vocabularies have -> (drafter ids (n,), target ids (n,)), pair i the same
    token; one-to-one (the first id of a key that a vocabulary holds twice)."""
    target_ids: dict[object, int] = {}
    for token_id, key in enumerate(token_keys(target_tokenizer, target_width)):
        if key is not None:
            target_ids.setdefault(key, token_id)
    pairs, used = [], set()
    for token_id, key in enumerate(token_keys(drafter_tokenizer, drafter_width)):
        match = target_ids.get(key)
        if match is not None and match not in used:
            used.add(match)
            pairs.append((token_id, match))
    pairs_tensor = torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)
    return pairs_tensor[:, 0], pairs_tensor[:, 1]


def same_vocabulary(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    return a is b or a.get_vocab() == b.get_vocab()


def check_tokenizer(tokenizer: object, name: str, model: PreTrainedModel, model_name: str) -> PreTrainedTokenizerBase:
    """A transformers tokenizer whose vocabulary is its model's: len(tokenizer) tokens at most as many
    as the model's embedding rows, and no fewer than those rows less padding (1%, or 128 rows)."""
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise TypeError(f"{name} must be a transformers tokenizer (PreTrainedTokenizerBase), got {type(tokenizer).__name__}")
    tokens, rows = len(tokenizer), vocab_size(model)
    if tokens > rows or rows - tokens > max(PADDING_ROWS, rows // 100):
        raise ValueError(
            f"{name} has {tokens} tokens but the {model_name} has {rows} embedding rows: "
            f"pass the {model_name}'s own tokenizer as {name}"
        )
    return tokenizer
