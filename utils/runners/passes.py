"""One model's forward passes, the base of the runners that run a model: where inputs go, the CPU
shortcuts measured fastest for a pass over a few tokens, the pass counter and the timing of the
passes into the model's `PassCosts` (`utils/cost_model.py`).

The costs are given at construction (`utils.calibration.pass_costs(model)`, or None: no
shortcuts, no timing) and never set afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor
from transformers import PreTrainedModel

from utils import cpu_passes, threads
from utils.cost_model import PassCosts
from utils.cpu_passes import Shortcuts
from utils.runners import compat
from utils.runners.model_info import input_device, is_encoder_decoder, model_devices


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


def as_float(logits: Tensor) -> Tensor:
    """Logits in float32 (float64 kept: a float64 model is compared exactly)."""
    return logits if logits.dtype == torch.float64 else logits.float()


class ModelPasses:
    """Runs `model` over new ids with the runner's kwargs; every pass of every runner goes
    through `run` (`forward_passes` counts them)."""

    def __init__(self, model: PreTrainedModel, *, costs: PassCosts | None = None) -> None:
        self.model = model
        self.device = input_device(model)
        self.devices = model_devices(model)  # what a timing waits for: every device the model spans
        self.encoder_decoder = is_encoder_decoder(model)
        self.forward_passes = 0
        self._costs = costs
        self._cache_kwarg = compat.cache_keyword(model)
        self._logits_to_keep = compat.keeps_logits(model)
        self._few_token_pass = cpu_passes.FewTokenPass(model)

    @property
    def costs(self) -> PassCosts | None:
        """The model's pass costs: each pass over a few tokens uses the CPU shortcuts measured
        fastest here, and every cached pass after the prefill is timed to refine them."""
        return self._costs

    def run(self, ids: Tensor, kwargs: dict, *, timed: bool, shortcuts: Shortcuts | None = None, counted: bool = True):
        """One pass over `ids` with the CPU shortcuts measured fastest for this many new tokens
        (unless given), timed into `costs` when `timed` (a pass after the prefill: what a step
        costs) -> the model's outputs. `counted`: one more in `forward_passes` (not for the second and later
        pieces of one pass run in pieces: `StaticRunner._prompts_alone`)."""
        num_drafts = ids.numel() - 1  # rows through the linears: new tokens (of every beam) less one
        few = self._costs is not None and num_drafts < cpu_passes.MAX_ROWS
        if shortcuts is None and few:
            shortcuts = self._costs.shortcuts_for(num_drafts)
        if timed and few:
            synchronize(*self.devices)  # the clock starts when the queued work is done, not before
        threads.fair_share()  # the free cores' threads, beside other processes
        start = time.perf_counter()
        with self._few_token_pass.using(shortcuts or Shortcuts()):
            outputs = self._call(ids, kwargs)
        if timed and few:
            synchronize(*self.devices)
            self._costs.observe(num_drafts, time.perf_counter() - start)
        self.forward_passes += counted
        return outputs

    @contextmanager
    def lent(self, model: PreTrainedModel, costs: PassCosts | None, few_token_pass) -> Iterator[Callable[[], int]]:
        """This runner's passes run `model` inside the block, with its pass costs and CPU shortcuts (another model
        over this runner's cache: a self-drafter, `utils.runners.shared_cache`) -> how many passes the block ran
        so far; after it, the runner is its own again, those passes not counted as its own."""
        saved = (self.model, self._costs, self._few_token_pass, self.forward_passes)
        self.model, self._costs, self._few_token_pass = model, costs, few_token_pass
        try:
            yield lambda: self.forward_passes - saved[3]
        finally:
            self.model, self._costs, self._few_token_pass, self.forward_passes = saved

    def run_batch(self, ids: Tensor, kwargs: dict):
        """`run` for a pass feeding (rows, width) `ids` of a shared batch, timed apart from the
        one-row table: B rows cost more than one row of as many tokens (each row attends to its
        own cache); `PassCosts.batch_ratio` reads these timings."""
        if self._costs is not None:
            synchronize(*self.devices)
        start = time.perf_counter()
        outputs = self.run(ids, kwargs, timed=False)
        if self._costs is not None:
            synchronize(*self.devices)
            self._costs.observe_batch(ids.shape[0], ids.shape[1], time.perf_counter() - start)
        return outputs

    def _no_logits(self) -> Tensor:
        """What a row fed nothing gets back."""
        return torch.empty(0, 0, device=self.device)

    def _call(self, ids: Tensor, kwargs: dict):
        """One forward pass of the model over `ids` (rows, new) with the prepared kwargs."""
        return self.model(input_ids=ids, **kwargs)
