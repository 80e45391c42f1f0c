"""A fixed-size KV buffer (gpt-fast's `KVCache`): every layer's keys and values in tensors allocated
once, each pass written at explicit slots, rollback by moving a length.

Shapes: keys and values of layer l, (rows, kv_heads, slots, head_dim). Row b's tokens occupy its
slots 0 .. length_b - 1, in order (the lengths live in the runner, `utils/runners/static.py`); a
pass writes its new keys at `write_index` (rows, width), row b's slots length_b, length_b + 1, ...,
and returns the whole buffer: the runner's 4D mask decides what each query sees, so slots past a
row's length (rejected drafts, padding, an earlier generation's keys) are never read. That is why
rollback copies nothing: the next pass overwrites the slots it forgot.

Only our own forward (`llama.py`, `gemma.py`; the native stack) writes and reads it: `write` (Python layers over
torch) or `layer` (the buffers our kernels write into). It is not a transformers cache: a model our forward does
not run keeps transformers' own caches (`utils/runners/sequence.py`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class PassSlots(NamedTuple):
    """Where one pass's new tokens sit: their positions (rows, width), the float mask (rows, 1, width, used) over
    the buffer's first `used` slots (0: seen, the dtype's minimum: hidden), the slots they are written to
    (rows, width), and for one row its first slot (`start`: a plain copy), else None. A model that mixes sliding
    and full attention layers (Gemma 2 and 3) also gets `sliding_mask`, the mask within its window for the sliding
    layers (`mask` is then the full layers'). `bounds`: where the runner knows the largest slot and position from
    its own integers, so that the check before our kernels write reads no tensor (`layer_ops.check_slots`)."""

    positions: Tensor
    mask: Tensor
    write_index: Tensor
    start: int | None
    sliding_mask: Tensor | None = None
    bounds: tuple[int, int] | None = None  # (the largest slot, the largest position), from the runner's own integers
    causal: bool = False  # `mask` is the causal mask over the pass's own tokens from slot 0 (one row's prompt)


class StaticKV:
    """Keys and values of `layers` layers for `rows` rows of `slots` positions each."""

    def __init__(self, *, rows: int, slots: int) -> None:
        self._shape = (rows, slots)
        # Allocated by the first pass (the eager prefill), layer by layer, where each layer runs and
        # in the dtype of its keys: nothing here reads the model's config.
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []

    @property
    def rows(self) -> int:
        return self._shape[0]

    @property
    def slots(self) -> int:
        return self._shape[1]

    def write(self, layer_idx: int, key: Tensor, value: Tensor, write_index: Tensor,
              start: int | None = None) -> tuple[Tensor, Tensor]:
        """Write a pass's new (rows, kv_heads, width, head_dim) keys and values at `write_index` (rows, width), or for
        one row from `start`, its first slot (a plain copy into consecutive slots) -> the layer's whole buffers,
        (rows, kv_heads, slots, head_dim)."""
        return _written(*self.layer(layer_idx, key), key, value, write_index, start)

    def layer(self, layer_idx: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """Layer `layer_idx`'s keys and values, allocated at its first pass (layers come in order) with `like`'s
        heads, head size, dtype and device (a (rows, kv_heads, width, head_dim) tensor of the pass's keys)."""
        if layer_idx == len(self.keys):
            shape = (self.rows, like.shape[1], self.slots, like.shape[3])
            self.keys.append(like.new_zeros(shape))
            self.values.append(like.new_zeros(shape))
        keys = self.keys[layer_idx]
        if keys.dtype != like.dtype or keys.shape[1] != like.shape[1] or keys.shape[3] != like.shape[3]:
            # A model computing in another dtype over this buffer (a drafter lent the target's cache) would have
            # our kernels read it as the wrong type.
            raise ValueError(f"layer {layer_idx}'s buffer holds {keys.shape[1]} heads of {keys.shape[3]} in "
                             f"{keys.dtype}; a pass wrote {like.shape[1]} heads of {like.shape[3]} in {like.dtype}")
        return keys, self.values[layer_idx]

    def take_prefix(self, source: StaticKV, length: int) -> None:
        """Every row's first `length` slots <- row 0's of `source` (a call's kept keys and values: `PromptCache`),
        this buffer's layers allocated like the source's (heads, head size, dtype, device) if they are not yet."""
        for i, (keys, values) in enumerate(zip(source.keys, source.values, strict=True)):
            mine_k, mine_v = self.layer(i, keys[:1, :, :0])
            mine_k[:, :, :length] = keys[:1, :, :length]
            mine_v[:, :, :length] = values[:1, :, :length]

    def move_positions(self, row: int, source: list[int], start: int) -> None:
        """Copy row `row`'s keys and values at slots `source` to slots start, start + 1, ... (a
        tree's accepted path into place)."""
        index = torch.tensor(source)
        for keys, values in zip(self.keys, self.values, strict=True):
            there = index.to(keys.device)
            keys[row, :, start : start + len(source)] = keys[row].index_select(1, there)
            values[row, :, start : start + len(source)] = values[row].index_select(1, there)

    def select_rows(self, keep: list[int]) -> None:
        """Keep only the rows `keep`, in that order (new tensors: a new batch size)."""
        index = torch.tensor(keep)
        self._shape = (len(keep), self.slots)
        self.keys = [keys.index_select(0, index.to(keys.device)) for keys in self.keys]
        self.values = [values.index_select(0, index.to(values.device)) for values in self.values]


class RowsKV:
    """Rows `start` to `stop` - 1 of a `StaticKV`, as a buffer of those rows: a pass over them alone writes into the
    whole buffer's memory (a batch's prompts computed one by one, `StaticRunner._prompts_alone`; a wide pass in
    groups of rows, `StaticRunner._in_groups`)."""

    def __init__(self, whole: StaticKV, start: int, stop: int) -> None:
        self.whole, self.start, self.stop = whole, start, stop

    @property
    def rows(self) -> int:
        return self.stop - self.start

    @property
    def slots(self) -> int:
        return self.whole.slots

    def layer(self, layer_idx: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """The rows' keys and values of layer `layer_idx` (views: contiguous, the buffer's own memory)."""
        keys, values = self.whole.layer(layer_idx, like)
        return keys[self.start : self.stop], values[self.start : self.stop]

    def write(self, layer_idx: int, key: Tensor, value: Tensor, write_index: Tensor,
              start: int | None = None) -> tuple[Tensor, Tensor]:
        """`StaticKV.write` into the rows' views."""
        return _written(*self.layer(layer_idx, key), key, value, write_index, start)


def _written(keys: Tensor, values: Tensor, key: Tensor, value: Tensor, write_index: Tensor,
             start: int | None) -> tuple[Tensor, Tensor]:
    """`key` and `value` (rows, kv_heads, width, head_dim) written into the buffers `keys` and `values` at
    `write_index` (rows, width), or from slot `start` on (one row: a plain copy) -> the buffers."""
    if start is not None:
        width = key.shape[2]
        keys[:, :, start : start + width] = key
        values[:, :, start : start + width] = value
        return keys, values
    index = write_index.to(keys.device)[:, None, :, None].expand(-1, key.shape[1], -1, key.shape[3])
    keys.scatter_(2, index, key.to(keys.dtype))
    values.scatter_(2, index, value.to(values.dtype))
    return keys, values
