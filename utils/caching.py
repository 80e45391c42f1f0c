"""The model runner: one Hugging Face model, its KV cache, and the tokens it has seen.

This is the only module that knows how transformers releases differ (4.56+ and 5.x):
- the cache keyword of `forward` (`past_key_values`, renamed `cache` in 5.24);
- `Cache.crop(-k)` removes the last k positions on every release (a positive argument changed
  meaning in 5.15, so it is never used here);
- sliding-window layers (Mistral, Gemma-2 style) keep only the last window of keys, which makes a
  rejected draft impossible to roll back. The runner therefore builds a plain `DynamicCache()`
  without the model config: every layer keeps its full history, and the model's own sliding-window
  attention mask still restricts what each layer attends to, so the output is unchanged.

Invariant (checked after every call): the cache holds exactly `len(runner)` positions, the first
`len(runner)` entries of `runner.tokens`.

Batches (`rows` > 1). Where the model takes a custom 4D mask and position ids (decoder-only, eager
or SDPA attention, one kind of layer, with a cache), the rows share one cache and every pass: the
rows' slots and blocks are laid out by `utils/batch_layout.py` (dead slots for padding and
rejected drafts, compacted when they pile up). Other models (encoder-decoder, flash attention,
use_cache=False) keep each row in its own one-row runner, one pass per row: the same tokens, no
shared passes. A batch whose rows have all finished but one goes back to the one-row layout.
"""

from __future__ import annotations

import functools
import inspect
import time

import torch
from torch import Tensor
from transformers import DynamicCache, EncoderDecoderCache, PreTrainedModel

from utils import cpu_passes
from utils.batch_layout import Block, attention_mask, compaction
from utils.cost_model import PassCosts
from utils.cpu_passes import Shortcuts

__all__ = ["ModelRunner", "context_length", "input_device", "is_encoder_decoder", "vocab_size"]


def is_encoder_decoder(model: PreTrainedModel) -> bool:
    return bool(getattr(model.config, "is_encoder_decoder", False))


def _decoder_config(model: PreTrainedModel):
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def context_length(model: PreTrainedModel) -> int | None:
    """The largest number of positions the (decoder of the) model accepts, None if unbounded."""
    config = _decoder_config(model)
    for name in ("max_position_embeddings", "n_positions", "max_target_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None  # relative position schemes (T5) have no hard limit


def vocab_size(model: PreTrainedModel) -> int:
    """Width of the model's logits (may exceed the tokenizer's size: padded embeddings)."""
    embeddings = model.get_output_embeddings()
    if embeddings is not None and hasattr(embeddings, "weight"):
        return int(embeddings.weight.shape[0])
    return int(_decoder_config(model).vocab_size)


def input_device(model: PreTrainedModel) -> torch.device:
    """Where the model's input ids must go: the device its input embeddings run on.

    Not `model.device`: a model dispatched by accelerate (`device_map`) may be split over devices
    or offloaded to disk, where `model.device` is the first parameter's device (`meta` when
    offloaded). Accelerate's hook on the embeddings knows the execution device; without a hook the
    embedding weights' device is the answer.
    """
    embeddings = model.get_input_embeddings()
    hook_device = getattr(getattr(embeddings, "_hf_hook", None), "execution_device", None)
    if hook_device is not None:
        return torch.device(f"cuda:{hook_device}" if isinstance(hook_device, int) else hook_device)
    device = embeddings.weight.device
    return torch.device("cpu") if device.type == "meta" else device


def model_devices(model: torch.nn.Module) -> tuple[torch.device, ...]:
    """The devices that hold the model's parameters (several with a `device_map`; `meta`, an
    offloaded weight, is left out: accelerate runs it on another)."""
    devices = {parameter.device for parameter in model.parameters()}
    return tuple(sorted((d for d in devices if d.type != "meta"), key=str))


def synchronize(*devices: torch.device) -> None:
    """Wait for the queued work of every device (accelerators run asynchronously) before a clock is
    read: CUDA, XPU and MPS; the CPU runs synchronously."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elif device.type == "xpu" and hasattr(torch, "xpu"):
            torch.xpu.synchronize(device)
        elif device.type == "mps" and hasattr(torch, "mps"):
            torch.mps.synchronize()


def _index_on(index: Tensor, device: torch.device, copies: dict[torch.device, Tensor]) -> Tensor:
    """`index` on `device`, copied there once per call: the layers of a model split by `device_map`
    live on several devices, and each layer's cache is indexed where it lives."""
    if device not in copies:
        copies[device] = index.to(device)
    return copies[device]


@functools.cache
def _forward_parameters(model_class: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_class.forward).parameters)


class ModelRunner:
    """Feeds new tokens to a model and returns their logits, keeping the KV cache in step.

    Decoder-only: `forward(tokens)` extends the sequence. Encoder-decoder: the encoder runs once, in
    the constructor, on `encoder_input_ids`; `forward` then extends the decoder's sequence.
    With `use_cache=False` every call recomputes the whole sequence (same interface, same logits).
    `rows` > 1: a batch (layout in the module docstring); `forward_rows`, `rollback_row`,
    `keep_path_row` and `select_rows` work row by row, and with one row they are the one-sequence
    calls `forward`, `forward_tree`, `rollback` and `keep_path`.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        use_cache: bool = True,
        encoder_input_ids: list[int] | list[list[int]] | None = None,
        rows: int = 1,
    ) -> None:
        self.model = model
        self.use_cache = use_cache
        self.device = input_device(model)
        self.devices = model_devices(model)  # what a timing waits for: every device the model spans
        self.rows: list[list[int]] = [[] for _ in range(rows)]  # each row's tokens in the cache
        self.forward_passes = 0
        # Several rows: one shared cache with live slots (`_live`, `_positions`: (rows, slots)), or
        # one one-row runner per row (`_solo`) for models that cannot take a custom mask.
        self._live: Tensor | None = None
        self._positions: Tensor | None = None
        self._solo: list[ModelRunner] | None = None
        if rows > 1:
            if self._shares_passes(model, use_cache):
                self._live = torch.zeros(rows, 0, dtype=torch.bool)
                self._positions = torch.zeros(rows, 0, dtype=torch.long)
                encoder_input_ids = None
            else:
                self._solo = [ModelRunner(model, use_cache=use_cache, encoder_input_ids=ids)
                              for ids in (encoder_input_ids or [None] * rows)]
                encoder_input_ids = None
                use_cache = False  # the solo runners hold the caches
        parameters = _forward_parameters(type(model))
        self._cache_kwarg = "cache" if "cache" in parameters else "past_key_values"
        self._logits_to_keep = "logits_to_keep" in parameters
        self.encoder_decoder = is_encoder_decoder(model)
        self._encoder_outputs = None
        if self.encoder_decoder and self._solo is None:
            assert encoder_input_ids is not None, "an encoder-decoder runner needs encoder_input_ids"
            with torch.no_grad():
                ids = torch.tensor([encoder_input_ids], device=self.device)
                self._encoder_outputs = model.get_encoder()(input_ids=ids, return_dict=True)
        self._cache = self._new_cache() if use_cache else None
        self._few_token_pass = cpu_passes.FewTokenPass(model)
        # Set by the decoding functions (`utils.calibration.pass_costs`): each pass over a few tokens
        # uses the CPU shortcuts measured fastest here, and every cached pass is timed to refine it.
        self.costs: PassCosts | None = None

    def _new_cache(self):
        # No config on purpose: full-history layers everywhere, so any suffix can be cropped.
        if self.encoder_decoder:
            return EncoderDecoderCache(DynamicCache(), DynamicCache())
        return DynamicCache()

    @property
    def tokens(self) -> list[int]:
        """The one row's tokens (a one-row runner)."""
        assert len(self.rows) == 1 and self._solo is None, "a batch has one token list per row: runner.rows"
        return self.rows[0]

    @tokens.setter
    def tokens(self, value: list[int]) -> None:
        assert len(self.rows) == 1 and self._solo is None
        self.rows[0] = value

    def __len__(self) -> int:
        return len(self.tokens)

    def row_length(self, row: int) -> int:
        """How many tokens of row `row` the cache holds."""
        return len(self._solo[row].tokens) if self._solo is not None else len(self.rows[row])

    def _cached_positions(self) -> int:
        return self._cache.get_seq_length() if self._cache is not None else len(self.tokens)

    @torch.no_grad()
    def forward(self, new_tokens: list[int], num_logits: int = 1, *, shortcuts: Shortcuts | None = None) -> Tensor:
        """Append `new_tokens` and return the logits of the last `num_logits` positions.

        Returns (num_logits, vocab), float32 (float64 if the model is), on the model's device.
        Row i is the distribution of the token that follows position len(self) - num_logits + i.
        `shortcuts` overrides the CPU shortcuts chosen by `costs` (calibration uses it).
        """
        assert new_tokens, "forward needs at least one new token"
        assert 1 <= num_logits <= len(self.tokens) + len(new_tokens)
        extends_cache = self.use_cache and len(self.tokens) > 0  # not the prefill: a verification-sized pass
        self.tokens.extend(new_tokens)
        if self.use_cache:
            ids = new_tokens
            kwargs = {self._cache_kwarg: self._cache, "use_cache": True}
        else:
            ids = self.tokens
            kwargs = {"use_cache": False}
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = num_logits
        ids = torch.tensor([ids], device=self.device)
        outputs = self._timed_call(ids, kwargs, timed=extends_cache, shortcuts=shortcuts)
        assert self._cached_positions() == len(self.tokens), "cache out of step with the tokens"
        logits = outputs.logits[0, -num_logits:]
        return logits if logits.dtype == torch.float64 else logits.float()

    def _timed_call(self, ids: Tensor, kwargs: dict, *, timed: bool, shortcuts: Shortcuts | None = None):
        """`_call` with the CPU shortcuts measured fastest for this many new tokens (unless given),
        timed into `costs` when `timed` (a pass after the prefill: what a step costs)."""
        num_drafts = ids.numel() - 1  # rows through the linears: new tokens (of every beam) less one
        few = self.costs is not None and num_drafts < cpu_passes.MAX_ROWS
        if shortcuts is None and few:
            shortcuts = self.costs.shortcuts_for(num_drafts)
        if timed and few:
            synchronize(*self.devices)  # the clock starts when the queued work is done, not before
        start = time.perf_counter()
        with self._few_token_pass.using(shortcuts or Shortcuts()):
            outputs = self._call(ids, kwargs)
        if timed and few:
            synchronize(*self.devices)
            self.costs.observe(num_drafts, time.perf_counter() - start)
        self.forward_passes += 1
        return outputs

    def _call(self, ids: Tensor, kwargs: dict):
        """One forward pass of the model over `ids` (1, new) with the prepared kwargs."""
        if self.encoder_decoder:
            return self.model(encoder_outputs=self._encoder_outputs, decoder_input_ids=ids, **kwargs)
        if "attention_mask" not in kwargs:
            # One unpadded sequence: an all-ones mask over past + new positions (GPT-2 warns without).
            kwargs["attention_mask"] = torch.ones(1, len(self.tokens), dtype=torch.long, device=self.device)
        return self.model(input_ids=ids, **kwargs)

    @staticmethod
    def _shares_passes(model: PreTrainedModel, use_cache: bool) -> bool:
        """Whether the model takes a custom 4D mask with per-row positions exactly: decoder-only, with
        a cache, eager or SDPA attention, layers that share one mask (no mix of sliding and full)."""
        config = _decoder_config(model)
        layer_types = set(getattr(config, "layer_types", None) or [])
        return (use_cache and not is_encoder_decoder(model) and len(layer_types) <= 1
                and getattr(config, "_attn_implementation", None) in ("eager", "sdpa"))

    @property
    def supports_trees(self) -> bool:
        """Whether `forward_tree` (and tree blocks in `forward_rows`) is exact for this model (see
        `_shares_passes`). Others verify chains (`forward`)."""
        return self._solo is None and self._shares_passes(self.model, self.use_cache)

    def _sliding_window(self) -> int | None:
        config = _decoder_config(self.model)
        window = getattr(config, "sliding_window", None)
        if not window or getattr(config, "use_sliding_window", True) is False:
            return None
        return int(window)

    @torch.no_grad()
    def forward_tree(self, root: int, tokens: list[int], parents: list[int]) -> Tensor:
        """Append the accepted token `root` and a tree of drafts, all in one pass -> (1 + n, vocab).

        Node i proposes tokens[i] after its parent (parents[i] < i; -1 is `root`). Each node attends
        to the cached sequence, the root and its own ancestors (a float 4D mask; a sliding window is
        folded in) at position len(self) + depth. Row 0 scores the token after the root, row 1 + i
        the token after node i. Until `keep_path`, the cache holds every node, in order.
        """
        assert self.supports_trees and all(parent < node for node, parent in enumerate(parents))
        past = len(self.tokens)
        q = 1 + len(tokens)
        index_parents = [-1] + [parent + 1 for parent in parents]  # in the block: the root is 0, node i is 1 + i
        depth = [0] * q
        allowed = torch.zeros(q, q, dtype=torch.bool)
        for j in range(q):
            if j:
                depth[j] = depth[index_parents[j]] + 1
                allowed[j] = allowed[index_parents[j]]
            allowed[j, j] = True
        positions = torch.tensor([past + d for d in depth])
        visible = torch.cat([torch.ones(q, past, dtype=torch.bool), allowed], dim=1)
        window = self._sliding_window()
        if window is not None:  # key position > query position - window, as the model's own mask
            key_positions = torch.cat([torch.arange(past), positions])
            visible &= key_positions[None, :] > positions[:, None] - window
        dtype = self.model.get_input_embeddings().weight.dtype
        mask = torch.zeros(1, 1, q, past + q, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)
        self.tokens += [root, *tokens]
        kwargs = {self._cache_kwarg: self._cache, "use_cache": True, "attention_mask": mask.to(self.device),
                  "position_ids": positions[None].to(self.device)}
        outputs = self._timed_call(torch.tensor([[root, *tokens]], device=self.device), kwargs, timed=True)
        assert self._cached_positions() == len(self.tokens), "cache out of step with the tree"
        logits = outputs.logits[0]
        return logits if logits.dtype == torch.float64 else logits.float()

    def keep_path(self, root_index: int, path: list[int]) -> None:
        """After `forward_tree`, keep the root (at `root_index`) and the accepted nodes `path`
        (root to leaf), forget every other node: the path's keys and values are copied into the
        positions right after the root (only those few rows move), then the rest is cropped."""
        start = root_index + 1
        source = [start + node for node in path]
        if source != list(range(start, start + len(path))):
            index, copies = torch.tensor(source), {}
            for layer in self._cache.layers:
                index_there = _index_on(index, layer.keys.device, copies)
                layer.keys[..., start : start + len(path), :] = layer.keys.index_select(-2, index_there)
                layer.values[..., start : start + len(path), :] = layer.values.index_select(-2, index_there)
        self.tokens[start : start + len(path)] = [self.tokens[i] for i in source]
        self.rollback(start + len(path))

    def rollback(self, length: int) -> None:
        """Forget every position from `length` on (the rejected drafts)."""
        assert 0 <= length <= len(self.tokens)
        removed = len(self.tokens) - length
        if removed == 0:
            return
        del self.tokens[length:]
        if self._cache is not None:
            if length == 0:
                self._cache = self._new_cache()
            else:
                self._cache.crop(-removed)  # negative: "remove this many" on every release
        assert self._cached_positions() == len(self.tokens), "cache out of step after rollback"


    # Batches: one block per row per pass ----------------------------------------------------------

    @torch.no_grad()
    def forward_rows(self, blocks: list[tuple[list[int], list[int] | None]], num_logits: list[int]) -> list[Tensor]:
        """Feed each row its block in one pass (one pass per row for a `_solo` batch) -> per row the
        logits of the block's last `num_logits[b]` tokens, (num_logits[b], vocab).

        `blocks[b]` = (tokens, parents): parents None for a chain, else a tree (-1 for the block's
        first token, the root; `forward_tree`'s rows). An empty block feeds nothing to that row.
        """
        if self._solo is not None:
            out = []
            for runner, (tokens, parents), num in zip(self._solo, blocks, num_logits, strict=True):
                assert parents is None, "a one-pass-per-row batch verifies chains"
                runner.costs = self.costs
                out.append(runner.forward(tokens, num) if tokens else self._no_logits())
                self.forward_passes += bool(tokens)
            return out
        if self._live is None:  # one row: the one-sequence passes
            (tokens, parents), num = blocks[0], num_logits[0]
            if not tokens:
                return [self._no_logits()]
            if parents is None:
                return [self.forward(tokens, num)]
            return [self.forward_tree(tokens[0], tokens[1:], [parent - 1 for parent in parents[1:]])[-num:]]
        return self._forward_shared(blocks, num_logits)

    def _no_logits(self) -> Tensor:
        return torch.empty(0, 0, device=self.device)

    def _forward_shared(self, blocks, num_logits: list[int]) -> list[Tensor]:
        if self._live.shape[1] == 0 and all(parents is None for _, parents in blocks):
            return self._prefill_rows(blocks, num_logits)
        self._tidy()
        block = Block.build(blocks, [len(row) for row in self.rows])
        dtype = self.model.get_input_embeddings().weight.dtype
        mask = attention_mask(self._live, self._positions, block, self._sliding_window(), dtype)
        kwargs = {self._cache_kwarg: self._cache, "use_cache": True, "attention_mask": mask.to(self.device),
                  "position_ids": block.positions.to(self.device)}
        width = block.ids.shape[1]
        keep = max(1, max(num_logits))  # blocks are left-padded: the last positions line up
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = keep
        # Timed apart from the one-row table: B rows cost more than one row of as many tokens (each
        # row attends to its own cache); `PassCosts.batch_ratio` reads these timings.
        if self.costs is not None:
            synchronize(*self.devices)
        start = time.perf_counter()
        outputs = self._timed_call(block.ids.to(self.device), kwargs, timed=False)
        if self.costs is not None:
            synchronize(*self.devices)
            self.costs.observe_batch(len(self.rows), width, time.perf_counter() - start)
        self._live = torch.cat([self._live, block.live], dim=1)
        self._positions = torch.cat([self._positions, block.positions], dim=1)
        for row, (tokens, _) in zip(self.rows, blocks, strict=True):
            row += tokens
        assert self._cache.get_seq_length() == self._live.shape[1], "cache out of step with the slots"
        logits = outputs.logits[:, -keep:] if outputs.logits.shape[1] == width else outputs.logits
        logits = logits if logits.dtype == torch.float64 else logits.float()
        return [logits[b, keep - num :] if num else self._no_logits() for b, num in enumerate(num_logits)]

    def _prefill_rows(self, blocks, num_logits: list[int]) -> list[Tensor]:
        """An empty shared cache: each row's prompt in a pass of its own (prompts differ in length,
        and padding every row to the longest would multiply the prefill's work), then the rows'
        caches side by side, left-padded to the longest."""
        width = max(len(tokens) for tokens, _ in blocks)
        alone, logits = [], []
        for (tokens, _), num in zip(blocks, num_logits, strict=True):
            runner = ModelRunner(self.model, use_cache=True)
            runner.costs = self.costs
            if tokens:
                row_logits = runner.forward(tokens, max(num, 1))
                self.forward_passes += 1
            logits.append(row_logits[-num:] if tokens and num else self._no_logits())
            alone.append(runner)

        def padded(tensor: Tensor | None, template: Tensor) -> Tensor:
            missing = width - (tensor.shape[2] if tensor is not None else 0)
            pad = template.new_zeros(1, template.shape[1], missing, template.shape[3])
            return pad if tensor is None else torch.cat([pad, tensor], dim=2)

        self._cache = self._new_cache()
        for index, layer in enumerate(next(runner._cache.layers for runner in alone if runner.tokens)):
            own = [runner._cache.layers[index] if runner.tokens else None for runner in alone]
            keys = torch.cat([padded(o.keys if o else None, layer.keys) for o in own])
            values = torch.cat([padded(o.values if o else None, layer.values) for o in own])
            self._cache.update(keys, values, index)
        starts = torch.tensor([width - len(tokens) for tokens, _ in blocks])[:, None]
        self._live = torch.arange(width)[None, :] >= starts
        self._positions = (torch.arange(width)[None, :] - starts).clamp(min=0)
        for row, (tokens, _) in zip(self.rows, blocks, strict=True):
            row += tokens
        assert self._cache.get_seq_length() == width, "cache out of step with the prefilled rows"
        return logits

    def _tidy(self) -> None:
        """Crop slots dead in every row at the end; compact when dead slots are a quarter of the cache."""
        columns = self._live.any(dim=0).nonzero()
        dead_tail = self._live.shape[1] - (int(columns.max()) + 1 if len(columns) else 0)
        if dead_tail:
            self._cache.crop(-dead_tail)
            self._live, self._positions = self._live[:, :-dead_tail], self._positions[:, :-dead_tail]
        if self._live.shape[1] > 1.25 * int(self._live.sum(dim=1).max()) + 16:
            self._compact()

    def _compact(self) -> None:
        """Move each row's live slots together (left padding): a gather over the whole cache."""
        index, live = compaction(self._live)
        positions = self._positions.gather(1, index)
        gather, copies = index[:, None, :, None], {}
        for layer in self._cache.layers:
            there = _index_on(gather, layer.keys.device, copies)
            layer.keys = layer.keys.gather(2, there.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]))
            layer.values = layer.values.gather(2, there.expand(-1, layer.values.shape[1], -1, layer.values.shape[3]))
        self._live, self._positions = live, positions

    def _row_slots(self, row: int) -> Tensor:
        return self._live[row].nonzero()[:, 0]

    def rollback_row(self, row: int, length: int) -> None:
        """Forget row `row`'s tokens from `length` on (its rejected drafts)."""
        if self._solo is not None:
            self._solo[row].rollback(length)
        elif self._live is None:
            self.rollback(length)
        else:
            assert 0 <= length <= len(self.rows[row])
            self._live[row, self._row_slots(row)[length:]] = False
            del self.rows[row][length:]

    def keep_path_row(self, row: int, root_index: int, path: list[int]) -> None:
        """`keep_path` for row `row` after a tree block: its other nodes become dead slots."""
        if self._live is None:
            self.keep_path(root_index, path)
            return
        nodes = self._row_slots(row)[root_index + 1 :]
        dead = [slot for node, slot in enumerate(nodes.tolist()) if node not in set(path)]
        self._live[row, dead] = False
        tokens = self.rows[row]
        self.rows[row] = tokens[: root_index + 1] + [tokens[root_index + 1 + node] for node in path]

    def select_rows(self, keep: list[int]) -> None:
        """Keep only the rows `keep` (finished rows stop costing compute); one row left goes back
        to the one-row layout."""
        if self._solo is not None:
            self._solo = [self._solo[row] for row in keep]
            self.rows = [[] for _ in keep]
            return
        if self._live is None:
            assert keep == [0], "a one-row runner keeps its row"
            return
        index, copies = torch.tensor(keep, dtype=torch.long), {}
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(0, _index_on(index, layer.keys.device, copies))
            layer.values = layer.values.index_select(0, _index_on(index, layer.values.device, copies))
        self._live, self._positions = self._live[index], self._positions[index]
        self.rows = [self.rows[row] for row in keep]
        if len(keep) == 1:
            self._compact()
            self._live = self._positions = None
            assert self._cached_positions() == len(self.tokens), "cache out of step after the batch"


class BeamRunner(ModelRunner):
    """A `ModelRunner` over a batch of equally long sequences (beams) of a decoder-only model.

    Invariant: `sequences` is (beams, length) and the cache holds `length` positions of each beam.
    """

    def __init__(self, model: PreTrainedModel, *, use_cache: bool = True) -> None:
        super().__init__(model, use_cache=use_cache)
        self.sequences = torch.empty(1, 0, dtype=torch.long, device=self.device)

    def start(self, prefix: list[int]) -> Tensor:
        """Prefill one beam with `prefix` -> the logits of its next token, (1, vocab)."""
        self.sequences = torch.tensor([prefix], device=self.device)
        return self.forward(prefix)

    @torch.no_grad()
    def step(self, beam_idx: Tensor, tokens: Tensor) -> Tensor:
        """Beam i continues beam `beam_idx[i]` with `tokens[i]` -> next-token logits (beams, vocab)."""
        self.sequences = torch.cat([self.sequences[beam_idx], tokens[:, None]], dim=1)
        self.tokens = self.sequences[0].tolist()  # beam 0 stands for the length the cache holds
        kwargs = {"use_cache": self.use_cache, "attention_mask": torch.ones_like(self.sequences)}
        if self.use_cache:
            self._cache.reorder_cache(beam_idx)
            kwargs[self._cache_kwarg] = self._cache
            ids = tokens[:, None]
        else:
            ids = self.sequences
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        logits = self._timed_call(ids, kwargs, timed=False).logits[:, -1]  # a few beams: the measured shortcuts
        assert self._cached_positions() == len(self.tokens), "cache out of step with the beams"
        return logits if logits.dtype == torch.float64 else logits.float()
