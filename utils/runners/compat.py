"""Every difference between transformers releases (4.56+ and 5.x), and every touch of a `Cache`'s
insides: the runners call these functions and know no release.

- The cache keyword of `forward`: `past_key_values`, renamed `cache` in 5.24.
- `logits_to_keep`: only the last positions' logits are computed, where `forward` takes it.
- `Cache.crop(-k)` removes the last k positions on every release (a positive argument changed
  meaning in 5.15, so it is never used here).
- Sliding-window layers (Mistral, Gemma-2 style) keep only the last window of keys, which makes a
  rejected draft impossible to roll back. A cache is therefore built as a plain `DynamicCache()`
  without the model config: every layer keeps its full history, and the model's own sliding-window
  attention mask still restricts what each layer attends to, so the output is unchanged.
- A cache's layers hold `keys` and `values`, (batch, heads, positions, head_dim) each; the layers
  of a model split by `device_map` live on several devices, and each is indexed where it lives.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import Tensor
from transformers import DynamicCache, EncoderDecoderCache, PreTrainedModel


@functools.cache
def _forward_parameters(model_class: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_class.forward).parameters)


def cache_keyword(model: PreTrainedModel) -> str:
    """The name under which `model.forward` takes its cache."""
    return "cache" if "cache" in _forward_parameters(type(model)) else "past_key_values"


def keeps_logits(model: PreTrainedModel) -> bool:
    """Whether `model.forward` takes `logits_to_keep`."""
    return "logits_to_keep" in _forward_parameters(type(model))


def new_cache(encoder_decoder: bool) -> DynamicCache | EncoderDecoderCache:
    # No config on purpose: full-history layers everywhere, so any suffix can be cropped.
    if encoder_decoder:
        return EncoderDecoderCache(DynamicCache(), DynamicCache())
    return DynamicCache()


def cached_length(cache) -> int:
    """Positions the cache holds (per row of a batch)."""
    return cache.get_seq_length()


def crop(cache, removed: int) -> None:
    """Forget the last `removed` (> 0) positions."""
    cache.crop(-removed)  # negative: "remove this many" on every release


def reorder(cache, beam_idx: Tensor) -> None:
    """Row i of the cache becomes row `beam_idx[i]` (beam search)."""
    cache.reorder_cache(beam_idx)


def _index_on(index: Tensor, device: torch.device, copies: dict[torch.device, Tensor]) -> Tensor:
    """`index` on `device`, copied there once per call: the layers of a model split by `device_map`
    live on several devices, and each layer's cache is indexed where it lives."""
    if device not in copies:
        copies[device] = index.to(device)
    return copies[device]


def move_positions(cache, source: list[int], start: int) -> None:
    """Copy the keys and values at positions `source` to positions start, start + 1, ... (only
    those few positions move; a tree's accepted path into place)."""
    index, copies = torch.tensor(source), {}
    for layer in cache.layers:
        index_there = _index_on(index, layer.keys.device, copies)
        layer.keys[..., start : start + len(source), :] = layer.keys.index_select(-2, index_there)
        layer.values[..., start : start + len(source), :] = layer.values.index_select(-2, index_there)


def select_rows(cache, keep: Tensor) -> None:
    """Keep the batch rows `keep` (1-D indices), in that order."""
    copies: dict[torch.device, Tensor] = {}
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, _index_on(keep, layer.keys.device, copies))
        layer.values = layer.values.index_select(0, _index_on(keep, layer.values.device, copies))


def gather_slots(cache, index: Tensor) -> None:
    """Row b's slot j becomes its slot `index[b, j]`: a gather over every layer, (B, S') index."""
    gather, copies = index[:, None, :, None], {}
    for layer in cache.layers:
        there = _index_on(gather, layer.keys.device, copies)
        layer.keys = layer.keys.gather(2, there.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]))
        layer.values = layer.values.gather(2, there.expand(-1, layer.values.shape[1], -1, layer.values.shape[3]))


def side_by_side(caches: list, width: int) -> DynamicCache:
    """One batch cache from one-row caches (None: a row with nothing cached), each left-padded
    with zeros to `width` positions."""

    def padded(tensor: Tensor | None, template: Tensor) -> Tensor:
        missing = width - (tensor.shape[2] if tensor is not None else 0)
        pad = template.new_zeros(1, template.shape[1], missing, template.shape[3])
        return pad if tensor is None else torch.cat([pad, tensor], dim=2)

    batch = new_cache(encoder_decoder=False)
    for index, layer in enumerate(next(cache.layers for cache in caches if cache is not None)):
        own = [cache.layers[index] if cache is not None else None for cache in caches]
        keys = torch.cat([padded(o.keys if o else None, layer.keys) for o in own])
        values = torch.cat([padded(o.values if o else None, layer.values) for o in own])
        batch.update(keys, values, index)
    return batch
