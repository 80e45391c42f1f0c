"""Compiled passes over a static KV buffer: a model compiled once at a few fixed widths.

A pass over n new tokens runs at the smallest compiled width >= n, padded (`static.py`), so each
model compiles a handful of graphs, once, and every speculative method (a chain of gamma drafts,
a tree, a one-token step) reuses them. The shapes are fixed: one row, `slots` positions of KV
buffer, `width` new tokens. Passes that fit no graph (the prompt pass, a batch, a buffer grown
past `slots`) run eager over the same buffer: exact either way.

`compile_model(model)` compiles (a progress bar per width on stderr) and registers the model, so
that `make_runner` gives it a `StaticRunner`; `compiled_passes(model)` answers what was
registered. Inductor's caches (its FX graphs, autotuning) live under `SPECDEC_CACHE`
(`utils.paths.cache_dir() / "inductor"`), so that a later start of the same model on the same
machine finds its kernels there. A compile that fails (no C++ compiler, a model dynamo cannot
trace) leaves the model eager, with one warning that says why.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm
from transformers import PreTrainedModel

from utils.paths import cache_dir
from utils.runners.compile_cache import frozen_onednn_weights_cached, model_key
from utils.runners.model_info import context_length, shares_passes
from utils.runners.sequence import SequenceRunner
from utils.runners.static import StaticRunner

__all__ = ["DEFAULT_WIDTHS", "CompiledPasses", "compile_model", "compiled_passes", "forget", "inductor_cache_dir",
           "keep_widths", "register"]

# New tokens per pass that compile by default: the one-token pass, what plain decoding and a drafter
# model run most. Each graph holds its own packed copy of every weight (freezing), so each width adds
# the model's size in memory (the 1.5B compiled at 1, 4 and 16 took 18 GB and was killed on a 24 GB
# machine); wider passes run eager over the same buffer unless asked for (`widths=`).
DEFAULT_WIDTHS = (1,)
# Graphs whose GEMMs are autotuned: every width (minutes each on a 1.5B model, once per machine: the
# choices live in the cached graphs).
AUTOTUNE_WIDTHS = (1, 4, 8, 16)
DEFAULT_SLOTS = 2048  # KV positions per row; a longer request runs eager (no new graph)
PROBE_TOLERANCE = 0.1  # mean |static - growing| over mean |growing| logit that the probe lets pass

_ATTRIBUTE = "_specdec_compiled_passes"  # where a model keeps its passes: they live and die with it


def _graph(model: PreTrainedModel) -> Callable:
    """What a compiled graph computes: the logits of every new token, (rows, width, vocab). The
    model is the closure's, not an argument, so that its weights are the graph's constants
    (inductor's freezing packs them for its GEMM kernels) and each model compiles its own graphs."""

    def logits(ids: torch.Tensor, kwargs: dict) -> torch.Tensor:
        return model(input_ids=ids, **kwargs).logits

    return logits


@dataclass
class CompiledPasses:
    """A model's compiled passes: one graph per width, for one row over `slots` KV positions."""

    widths: tuple[int, ...]  # sorted; () = the static buffer without compiling (exact, eager)
    slots: int
    options: dict[int, dict] = field(default_factory=dict)  # width -> inductor's settings its graph was compiled with
    compile_seconds: dict[int, float] = field(default_factory=dict)  # width -> first call (the compile)
    _graphs: dict[int, Callable] = field(default_factory=dict, repr=False)

    def width_for(self, rows: int, longest: int) -> int | None:
        """The compiled width a pass of `rows` rows whose longest block has `longest` tokens runs
        at, None when no graph holds it (it runs eager at its own width)."""
        if rows != 1:
            return None
        return next((width for width in self.widths if width >= longest), None)

    def forward(self, rows: int, width: int) -> Callable | None:
        """The compiled graph for (rows, width), None where that pass runs eager."""
        return self._graphs.get(width) if rows == 1 else None


def compiled_passes(model: PreTrainedModel) -> CompiledPasses | None:
    """What `compile_model` registered for `model` (None: its runners are the eager ones)."""
    return getattr(model, _ATTRIBUTE, None)


def register(model: PreTrainedModel, passes: CompiledPasses) -> None:
    """Run `model` through `passes` (again, after `forget`: a benchmark compares both ways)."""
    model.__dict__[_ATTRIBUTE] = passes


def keep_widths(model: PreTrainedModel, widths: tuple[int, ...]) -> CompiledPasses:
    """Register only `widths` of `model`'s compiled passes (the others run eager) -> the passes kept."""
    passes = compiled_passes(model)
    assert passes is not None and set(widths) <= set(passes.widths), "keep widths that were compiled"
    def only(table: dict) -> dict:
        return {width: value for width, value in table.items() if width in widths}

    kept = CompiledPasses(tuple(sorted(widths)), passes.slots, only(passes.options), only(passes.compile_seconds),
                          only(passes._graphs))
    register(model, kept)
    return kept


def forget(model: PreTrainedModel) -> None:
    """Unregister `model`: its runners are the eager ones again (its graphs are dropped with it)."""
    model.__dict__.pop(_ATTRIBUTE, None)


def inductor_cache_dir() -> str:
    """Where inductor keeps its compiled kernels: under the project's cache folder."""
    return str(cache_dir() / "inductor")


def _use_project_cache() -> None:
    """Point inductor's caches at the project's folder, unless the user chose another one (inductor
    writes its default into the environment the first time it looks)."""
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        default = default_cache_dir()
    except ImportError:  # another torch release: only an unset variable is ours to set
        default = None
    if current is None or os.path.abspath(current) == os.path.abspath(default or current + "/"):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir()


def _options(model: PreTrainedModel, autotune: bool) -> dict:
    """Inductor's settings: weights frozen into the graph (constant folding, weights packed for the
    CPU's GEMM kernels) on CPU; with `autotune`, every GEMM of the graph timed here against
    inductor's own C++ micro-kernels (AVX2, AVX-512, AMX) and the fastest kept, ATen's included, so
    the choice is a measurement on this machine (a minute or more per graph of a 1.5B model)."""
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    options = {"freezing": True} if on_cpu else {}
    if autotune:
        options |= {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN" if on_cpu else "TRITON,ATEN"}
    return options


def compile_model(
    model: PreTrainedModel,
    *,
    widths: tuple[int, ...] = DEFAULT_WIDTHS,
    slots: int | None = None,
    autotune: tuple[int, ...] = AUTOTUNE_WIDTHS,
    progress: bool = True,
    description: str = "compiling",
) -> CompiledPasses | None:
    """Compile `model`'s passes at `widths` new tokens over a static buffer of `slots` positions
    (default: `DEFAULT_SLOTS`, at most the model's context) and register them, so that every
    decoding function runs it through a `StaticRunner`. `widths=()` registers the static buffer
    without compiling anything. Returns the registered passes, or None (the model stays eager,
    with one warning) where the model cannot run over a static buffer or the compile fails.
    The graphs are kept on disk (`compile_cache.py`): a later start of the same model on the same
    machine loads them. `description`: the progress bar's words (e.g. the wait expected)."""
    if not isinstance(widths, tuple) or not all(isinstance(w, int) and w >= 1 for w in widths):
        raise ValueError(f"widths must be a tuple of ints >= 1, got {widths!r}")
    if not shares_passes(model, use_cache=True):
        warnings.warn(f"{type(model).__name__} stays eager: a static buffer needs a decoder-only model with one kind "
                      "of attention layer, eager or SDPA attention", stacklevel=2)
        return None
    limit = context_length(model)
    slots = slots or (DEFAULT_SLOTS if limit is None else min(DEFAULT_SLOTS, limit))
    why = _static_buffer_differs(model, slots)
    if why is not None:
        warnings.warn(f"{type(model).__name__} stays eager: {why}", stacklevel=2)
        return None
    widths = tuple(sorted(set(widths)))
    passes = CompiledPasses(widths, slots, {width: _options(model, width in autotune) for width in widths})
    register(model, passes)  # before compiling: the graphs are traced with the model as it will run
    try:
        _compile_widths(model, passes, progress, description)
    except Exception as error:  # noqa: BLE001 - any compiler failure: eager is the fallback, never a failure
        forget(model)
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        warnings.warn(f"{type(model).__name__} stays eager: compiling failed ({type(error).__name__}: {first_line})",
                      stacklevel=2)
        return None
    return passes


def _static_buffer_differs(model: PreTrainedModel, slots: int) -> str | None:
    """Why the static buffer would not give this model's logits (None: it does). A probe, not a
    list of model classes: a prefix, then a chain of three tokens, through the static buffer (eager)
    and the growing cache. A model whose attention applies a causal mask of its own, which assumes
    that the new tokens are the cache's last positions (GPT-2 on transformers 4.x), fails it."""
    prefix, chain = list(range(3, 11)), [11, 12, 13]
    try:
        static, growing = StaticRunner(model, rows=1, slots=slots), SequenceRunner(model)
        for runner in (static, growing):
            runner.forward_rows([(prefix, None)], [1])
        got = static.forward_rows([(chain, None)], [len(chain)])[0]
        want = growing.forward_rows([(chain, None)], [len(chain)])[0]
    except (RuntimeError, ValueError, TypeError, IndexError) as error:
        return f"its attention does not take a static buffer ({type(error).__name__}: {str(error)[:120]})"
    # Rounding moves bfloat16 logits by ~2% on average (the 0.5B: 1.9%); a mask applied at the wrong
    # place changes what each query attends to, and the logits with it.
    if float((got - want).abs().mean()) > PROBE_TOLERANCE * float(want.abs().mean()):
        return "its attention does not take a static buffer's mask exactly (a causal mask of its own)"
    return None


def _compile_widths(model: PreTrainedModel, passes: CompiledPasses, progress: bool, description: str) -> None:
    """Compile one graph per width by running it once over a scratch buffer (the compile happens
    at the first call), each with a bar line saying which width it compiles."""
    if not passes.widths:
        return
    _use_project_cache()
    key = model_key(model)
    bar = tqdm(passes.widths, desc=description, unit="width", disable=not progress, leave=False)
    for width in bar:
        bar.set_postfix_str(f"{width} new token{'s' * (width > 1)}")
        passes._graphs[width] = torch.compile(_graph(model), dynamic=False)
        runner = StaticRunner(model, rows=1, slots=passes.slots, compiled=passes)
        runner.forward_rows([([0], None)], [1])  # the eager prompt pass allocates the buffer
        start = time.perf_counter()
        # The settings as inductor's config while it compiles (torch.compile's `options=` does not
        # reach freezing): the first call compiles this width.
        with (torch._inductor.config.patch(passes.options[width] | {"post_grad_custom_post_pass": key}),
              frozen_onednn_weights_cached()):
            runner.forward_rows([([0] * width, None)], [1])
        passes.compile_seconds[width] = time.perf_counter() - start
