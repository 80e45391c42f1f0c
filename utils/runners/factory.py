"""The one place that chooses a runner's mode from the model and the request."""

from __future__ import annotations

from transformers import PreTrainedModel

from utils.cost_model import PassCosts
from utils.freed_memory import keep_freed_memory
from utils.lean import lean_decoder
from utils.runners.beam import BeamRunner, StaticBeamRunner
from utils.runners.model_info import shares_passes
from utils.runners.per_row import PerRowRunner
from utils.runners.protocol import Runner
from utils.runners.sequence import SequenceRunner
from utils.runners.shared_batch import SharedBatchRunner
from utils.runners.static import StaticRunner

DRAFT_ROOM = 128  # slots past a row's budget: the widest draft block (a tree's nodes) and a padded pass
SLOTS_STEP = 256  # a static buffer's size is a multiple of this


def make_runner(
    model: PreTrainedModel,
    *,
    rows: int = 1,
    use_cache: bool = True,
    encoder_input_ids: list[list[int]] | None = None,
    costs: PassCosts | None = None,
    max_tokens: int | None = None,
) -> Runner:
    """A runner over `rows` sequences of `model`. A model our own forward runs (`utils.lean`; decoder-only,
    with a cache) -> a `StaticRunner` over a fixed KV buffer sized for `max_tokens` (the most tokens a row
    may hold before its drafts); else one row -> a `SequenceRunner`; a batch of a model that takes a custom 4D mask with a cache ->
    a `SharedBatchRunner` (one pass for every row); any other batch -> a `PerRowRunner` (one pass
    per row). `encoder_input_ids`: an encoder-decoder's encoder ids, one list per row (None for a
    decoder-only model); `costs`: the model's `PassCosts` (`utils.calibration.pass_costs`), or None
    (no CPU shortcuts, no timing)."""
    assert rows >= 1 and (encoder_input_ids is None or len(encoder_input_ids) == rows)
    keep_freed_memory()  # once a process: a pass's freed memory kept for the next (`utils/freed_memory.py`)
    if use_cache and lean_decoder(model) is not None and max_tokens is not None:
        # Our own forward takes every model it runs (a mask per kind of layer). Its buffer reaches past the model's
        # positions: a row near the end of the context still drafts (positions clamped; a token past the context is
        # never kept).
        slots = -(-(max_tokens + DRAFT_ROOM) // SLOTS_STEP) * SLOTS_STEP
        return StaticRunner(model, rows=rows, slots=slots, costs=costs)
    if rows == 1:
        ids = None if encoder_input_ids is None else encoder_input_ids[0]
        return SequenceRunner(model, use_cache=use_cache, encoder_input_ids=ids, costs=costs)
    if shares_passes(model, use_cache):
        return SharedBatchRunner(model, rows=rows, costs=costs)
    return PerRowRunner(model, rows=rows, use_cache=use_cache, encoder_input_ids=encoder_input_ids, costs=costs)


def make_beam_runner(model: PreTrainedModel, *, use_cache: bool, costs: PassCosts | None,
                     max_tokens: int) -> BeamRunner | StaticBeamRunner:
    """Beam search's runner: the beams as rows of a static buffer where our own forward runs `model` (with a
    cache), else over transformers' cache. `max_tokens`: the most tokens a beam may hold."""
    keep_freed_memory()
    if use_cache and lean_decoder(model) is not None:
        return StaticBeamRunner(model, slots=-(-(max_tokens + 1) // SLOTS_STEP) * SLOTS_STEP, costs=costs)
    return BeamRunner(model, use_cache=use_cache, costs=costs)
