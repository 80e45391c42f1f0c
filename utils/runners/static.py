"""The static runner: rows of a decoder-only model over one fixed-size KV buffer (`static_kv.py`),
gpt-fast's way: a pass writes its new tokens into slots of a buffer that never moves or grows.

Row b's tokens occupy its slots 0 .. len(rows[b]) - 1, at positions equal to their slots. A pass
feeds every row its block (a chain or a tree), right-padded to the longest block's width. Row b's
new token j is written at slot len(rows[b]) + j;
its query sees the row's slots below len(rows[b]) and its own ancestors in the block (itself
included), within the model's sliding window: one float 4D mask (rows, 1, width, slots) and
per-row position ids (a model that mixes sliding and full layers, Gemma 2 and 3: a mask of each kind, for our own
forward only). Padding queries see only themselves and their logits are dropped.
A block's tokens may be a tensor on the device (a drafter's drafts, `protocol.Blocks`): they are
written into the pass's ids there, never read back to the host.

A pass runs our own forward (`utils/lean/`): it reads the buffer only up to the longest row, by a mask over those
slots. A model our forward does not cover keeps transformers' own caches (`utils/runners/factory.py`).

Rollback is `del rows[b][length:]`: slots past a row's length are never seen, and the next pass
overwrites them. A tree's accepted path is copied into the slots after its root (`keep_path_row`).

Invariant: row b holds len(rows[b]) <= slots tokens; every pass fits (`fits`).
"""

from __future__ import annotations

import functools
import time
from types import SimpleNamespace

import torch
from torch import Tensor
from transformers import PreTrainedModel

from utils.cost_model import PassCosts
from utils.cpu_passes import Shortcuts
from utils.lean import forward_path, lean_decoder
from utils.lean.native import MAX_ROWS
from utils.lean.static_kv import PassSlots, RowsKV, StaticKV
from utils.runners.model_info import context_length, mixes_windows, sliding_window
from utils.runners.passes import ModelPasses, as_float, synchronize
from utils.runners.protocol import Blocks


def block_ids(blocks: Blocks, width: int, device: torch.device) -> Tensor:
    """Right-padded blocks -> their (rows, width) token ids on `device` (0 for padding). Lists of
    ids are laid out on the host and sent in one copy; a tensor block (a drafter's drafts, on the
    device already) is written there, never read back to the host."""
    ids = torch.zeros(len(blocks), width, dtype=torch.long)
    on_device = []
    for b, (tokens, _) in enumerate(blocks):
        if isinstance(tokens, Tensor):
            on_device.append(b)
        elif tokens:
            ids[b, : len(tokens)] = torch.tensor(tokens)
    ids = ids.to(device)
    for b in on_device:
        ids[b, : len(blocks[b][0])] = blocks[b][0]
    return ids


def block_layout(blocks: Blocks, width: int) -> tuple[Tensor, Tensor]:
    """Right-padded blocks -> (depths, ancestry): (rows, width) depth of each new token in its block
    (its position is the row's length plus it), and (rows, width, width) whether query i sees new
    token j (its ancestors and itself)."""
    rows = len(blocks)
    depths = torch.arange(width).repeat(rows, 1)
    ancestry = torch.eye(width, dtype=torch.bool).repeat(rows, 1, 1)
    for b, (tokens, parents) in enumerate(blocks):
        n = len(tokens)
        if n == 0:
            continue
        if parents is None:  # a chain: each token sees every one before it
            ancestry[b, :n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
            continue
        for j, parent in enumerate(parents):
            if parent >= 0:
                ancestry[b, j] |= ancestry[b, parent]
                depths[b, j] = depths[b, parent] + 1
            else:
                depths[b, j] = 0
    return depths, ancestry


def static_mask(lengths: Tensor, depths: Tensor, ancestry: Tensor, slots: int, window: int | None,
                dtype: torch.dtype) -> Tensor:
    """The float mask (rows, 1, width, slots) of a pass writing each row's block at its length."""
    rows, width = depths.shape
    slot = torch.arange(slots)
    offset = slot[None, :] - lengths[:, None]  # (rows, slots): slot's index in the block, < 0 before it
    in_block = (offset >= 0) & (offset < width)
    block_index = offset.clamp(0, width - 1)
    sees_block = ancestry.gather(2, block_index[:, None, :].expand(rows, width, slots)) & in_block[:, None, :]
    visible = (offset < 0)[:, None, :] | sees_block
    if window is not None:  # key position > query position - window, as the model's own mask
        key_positions = torch.where(in_block, lengths[:, None] + depths.gather(1, block_index), slot[None, :])
        query_positions = lengths[:, None] + depths
        visible &= key_positions[:, None, :] > query_positions[:, :, None] - window
    mask = torch.zeros(rows, 1, width, slots, dtype=dtype)
    return mask.masked_fill(~visible[:, None], torch.finfo(dtype).min)


class StaticRunner(ModelPasses):
    """`rows` sequences of a decoder-only model our own forward runs (`lean_decoder`) over a KV buffer of `slots`
    positions per row."""

    def __init__(self, model: PreTrainedModel, *, rows: int, slots: int, costs: PassCosts | None = None) -> None:
        super().__init__(model, costs=costs)
        lean = lean_decoder(model)
        if lean is None:
            raise ValueError(f"a static runner runs our own forward, which does not run {type(model).__name__}: "
                             f"{forward_path(model)}")
        # Each row's tokens, in its slots (one fed in a tensor block: a 0-d tensor, never read here).
        self.rows: list[list[int | Tensor]] = [[] for _ in range(rows)]
        self.slots = slots
        self._cache = StaticKV(rows=rows, slots=slots)
        self._window = sliding_window(model)
        self._mixed = mixes_windows(model)  # then `_window` is the sliding layers' only (our own forward)
        self._max_position = (context_length(model) or slots) - 1
        self._dtype = lean.dtype  # the masks' (a model lent the runner computes in it too: `can_share`)
        self._next_shortcuts: Shortcuts | None = None  # a pass's CPU shortcuts, None: the measured ones
        self._prompt_held = False  # its first row holds a kept prompt's tokens (`hold`): the next pass is the prompt's

    @property
    def supports_trees(self) -> bool:
        return True  # the mask is built per node

    @property
    def kv(self) -> StaticKV:
        """The buffer of keys and values (what a `PromptCache` keeps after a call)."""
        return self._cache

    def hold(self, kv: StaticKV, tokens: list[int], *, prompt_follows: bool) -> None:
        """Start the one row from a kept prompt (`utils.runners.prompt_cache`): `tokens`' keys and values, those of
        `kv`'s first slots, copied into this buffer. `prompt_follows`: the next pass reads the rest of the prompt
        (untimed, as a prompt pass is)."""
        assert len(self.rows) == 1 and not self.rows[0] and 0 < len(tokens) <= self.slots
        self._cache.take_prefix(kv, len(tokens))
        self.rows[0] = list(tokens)
        self._prompt_held = prompt_follows

    def row_length(self, row: int) -> int:
        return len(self.rows[row])

    def cache_bytes(self, tokens: int) -> int:
        """Bytes of the keys and values that `tokens` cached positions of every row hold (what a pass reads of them)."""
        cache = self._cache
        return sum(t.nbytes for t in (*cache.keys, *cache.values)) * tokens // cache.slots

    @torch.no_grad()
    def forward_rows(self, blocks: Blocks, num_logits: list[int]) -> list[Tensor]:
        """One pass feeding every row its block, right-padded (`Runner.forward_rows`); a tensor
        block's ids stay on the device (`block_ids`). A batch's pass over more tokens than our kernels take at once
        runs in pieces whose rows get the bits they get alone: each prompt alone (`_prompts_alone`), a later pass in
        groups of rows (`_in_groups`)."""
        width = max(len(tokens) for tokens, _ in blocks)
        if width == 0:
            return [self._no_logits() for _ in blocks]
        longest_row = max(len(row) for row in self.rows)
        if longest_row + width > self.slots:  # not an assert: our kernels write where the slots say
            raise ValueError(f"the static buffer holds {self.slots} slots a row: a pass of {width} tokens after "
                             f"{longest_row} does not fit")
        if len(blocks) > 1 and len(blocks) * width > MAX_ROWS:
            if not any(self.rows):
                return self._prompts_alone(blocks, num_logits)
            if width <= MAX_ROWS and lean_decoder(self.model).invariant:
                return self._in_groups(blocks, num_logits, width)
        return self._rows_pass(blocks, num_logits, 0, width, self._cache, self._pass)

    def _rows_pass(self, blocks: Blocks, num_logits: list[int], offset: int, width: int, kv, run) -> list[Tensor]:
        """One pass feeding rows offset, offset + 1, ... their blocks, right-padded to `width`, over `kv` (the whole
        buffer, or those rows of it: `RowsKV`); `run(ids, kwargs)`: the pass (`_pass`, or a piece of one)."""
        if not any(len(tokens) for tokens, _ in blocks):  # a group of rows fed nothing (`_in_groups`)
            return [self._no_logits() for _ in blocks]
        rows = self.rows[offset : offset + len(blocks)]
        lengths = [len(row) for row in rows]
        depths, ancestry = block_layout(blocks, width)
        length = torch.tensor(lengths)
        positions = (length[:, None] + depths).clamp(max=self._max_position).to(self.device)
        write_index = (length[:, None] + torch.arange(width)).to(self.device)
        first = min(len(tokens) - num for (tokens, _), num in zip(blocks, num_logits, strict=True) if len(tokens))
        # the runner's model's forward, or a model's lent it (`ModelPasses.lent`)
        kwargs = self._lean_kwargs(lean_decoder(self.model), length, depths, ancestry, positions, write_index,
                                   width - first, kv, lengths[0] if len(blocks) == 1 else None,
                                   max(lengths) + width - 1)
        logits = as_float(run(block_ids(blocks, width, self.device), kwargs))
        for row, (tokens, _) in zip(rows, blocks, strict=True):
            row += list(tokens)  # a tensor block's tokens stay 0-d tensors on the device: no host read
        return [logits[b, len(tokens) - num - first : len(tokens) - first] if len(tokens) and num else self._no_logits()
                for b, ((tokens, _), num) in enumerate(zip(blocks, num_logits, strict=True))]

    def _lean_kwargs(self, lean, length: Tensor, depths: Tensor, ancestry: Tensor, positions: Tensor,
                     write_index: Tensor, num_logits: int, kv, start: int | None, last_slot: int) -> dict:
        """Our own forward's arguments for a pass: it reads the buffer up to the longest row, in steps of its own
        (few mask shapes). `start`: one row's first new slot (None for a batch); `last_slot`: the largest slot it
        writes (a position is at most that, and the model's last), so that the slots are checked without reading
        the tensors."""
        used = min(self.slots, -(-(last_slot + 1) // lean.kv_step) * lean.kv_step)
        masks = [static_mask(length, depths, ancestry, used, window, self._dtype).to(self.device)
                 for window in ((None, self._window) if self._mixed else (self._window,))]
        width = depths.shape[1]
        # One row's chain from slot 0 whose mask no window narrows: the causal mask over its own tokens (`_attend`).
        causal = (start == 0 and torch.equal(ancestry[0], torch.ones(width, width, dtype=torch.bool).tril())
                  and (self._mixed or self._window is None or self._window >= width))
        slots = PassSlots(positions, masks[0], write_index, start, masks[1] if self._mixed else None,
                          (last_slot, min(last_slot, self._max_position)), causal)
        return {"slots": slots, "kv": kv, "num_logits": num_logits}

    def _prompts_alone(self, blocks: Blocks, num_logits: list[int]) -> list[Tensor]:
        """A batch's prompt pass over more tokens than our kernels take at once, each row alone into its own rows of
        the buffer: a wide pass's products are torch's, whose bits depend on the pass's shape (a padded batch's
        rows parted from the same rows alone at near-ties in bfloat16), so each row's prompt is computed as it would
        be alone, at its own width. Past the kernels' width the passes are compute-bound: the split costs little."""
        out, pieces = [], 0
        for b, (block, num) in enumerate(zip(blocks, num_logits, strict=True)):
            if not len(block[0]):
                out.append(self._no_logits())
                continue
            run = functools.partial(self._piece, counted=pieces == 0)  # one prompt pass, in pieces
            out += self._rows_pass([block], [num], b, len(block[0]), RowsKV(self._cache, b, b + 1), run)
            pieces += 1
        return out

    def _in_groups(self, blocks: Blocks, num_logits: list[int], width: int) -> list[Tensor]:
        """A batch's later pass over more tokens than our kernels take at once (rows x `width`), in groups of rows of
        at most `MAX_ROWS` tokens: each group's layers run in one native call, width-invariant, so that each row gets
        the bits it gets alone, where one wide pass would take torch's products, whose bits depend on the pass's
        shape (a batched row parted from itself alone at near-ties in bfloat16). Timed as the batch's pass
        (`PassCosts.batch_ratio`: what the batch rules price)."""
        size, out = MAX_ROWS // width, []
        synchronize(*self.devices)
        start = time.perf_counter()
        for offset in range(0, len(blocks), size):
            part = slice(offset, offset + size)
            kv = RowsKV(self._cache, offset, min(offset + size, len(blocks)))
            out += self._rows_pass(blocks[part], num_logits[part], offset, width, kv,
                                   functools.partial(self._piece, counted=offset == 0))
        if self._costs is not None:
            synchronize(*self.devices)
            self._costs.observe_batch(len(blocks), width, time.perf_counter() - start)
        return out

    def _piece(self, ids: Tensor, kwargs: dict, *, counted: bool) -> Tensor:
        """A piece of a pass run in pieces: untimed (its caller times the whole), counted once."""
        return self.run(ids, kwargs, timed=False, counted=counted).logits

    def _pass(self, ids: Tensor, kwargs: dict) -> Tensor:
        """The pass's logits (rows, width or fewer, vocab); timed after the prompt pass."""
        if not any(self.rows) or self._prompt_held:  # the prompt's pass, after a kept prefix or not
            self._prompt_held = False
            return self.run(ids, kwargs, timed=False).logits
        if len(self.rows) > 1:
            return self.run_batch(ids, kwargs).logits
        return self.run(ids, kwargs, timed=True, shortcuts=self._next_shortcuts).logits

    def _call(self, ids: Tensor, kwargs: dict):
        return SimpleNamespace(logits=lean_decoder(self.model)(ids, **kwargs))  # our own forward (`utils/lean/`)

    def rollback_row(self, row: int, length: int) -> None:
        assert 0 <= length <= len(self.rows[row])
        del self.rows[row][length:]  # the forgotten slots are overwritten by the next pass

    def keep_path_row(self, row: int, root_index: int, path: list[int]) -> None:
        """Copy the path's keys and values into the slots right after the root, then forget the rest."""
        start = root_index + 1
        source = [start + node for node in path]
        if source != list(range(start, start + len(path))):
            self._cache.move_positions(row, source, start)
        tokens = self.rows[row]
        self.rows[row] = tokens[:start] + [tokens[i] for i in source]

    def select_rows(self, keep: list[int]) -> StaticRunner:
        """Keep the rows `keep`, in that order (a gather of the buffer; a row kept twice is two rows: beams)."""
        if keep != list(range(len(self.rows))):
            self._cache.select_rows(keep)
            self.rows = [list(self.rows[row]) for row in keep]
        return self


class StaticSequence(StaticRunner):
    """One row over a static buffer with the one-sequence calls calibration times: `forward(tokens,
    num_logits=)` and `rollback(length)` (`shortcuts`: an eager pass's CPU shortcuts, as
    `SequenceRunner.forward` takes them)."""

    def __init__(self, model: PreTrainedModel, *, slots: int, costs: PassCosts | None = None) -> None:
        super().__init__(model, rows=1, slots=slots, costs=costs)

    def forward(self, new_tokens: list[int], num_logits: int = 1, *, shortcuts: Shortcuts | None = None) -> Tensor:
        self._next_shortcuts = shortcuts
        try:
            return self.forward_rows([(new_tokens, None)], [num_logits])[0]
        finally:
            self._next_shortcuts = None

    def rollback(self, length: int) -> None:
        self.rollback_row(0, length)
