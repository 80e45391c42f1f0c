"""The runners (utils/runners/): the factory's choice of mode, costs given whole, and a batch that
goes on as one sequence once its other rows have finished."""

from __future__ import annotations

import pytest

from tests.models import VOCAB, prompt, tiny_model
from utils.cost_model import prior_costs
from utils.runners import PerRowRunner, Runner, SequenceRunner, SharedBatchRunner, make_runner


def test_the_factory_chooses_the_mode_from_the_model_and_the_request():
    llama, t5, costs = tiny_model("llama"), tiny_model("t5"), prior_costs()
    cases = [
        (make_runner(llama, costs=costs), SequenceRunner),
        (make_runner(llama, rows=3, costs=costs), SharedBatchRunner),  # eager attention, a cache: one pass for all
        (make_runner(tiny_model("gpt2"), rows=2, costs=costs), SharedBatchRunner),
        (make_runner(llama, rows=2, use_cache=False, costs=costs), PerRowRunner),  # no cache to share
        (make_runner(t5, encoder_input_ids=[prompt(1)], costs=costs), SequenceRunner),
        (make_runner(t5, rows=2, encoder_input_ids=[prompt(1), prompt(2)], costs=costs), PerRowRunner),
    ]
    for runner, mode in cases:
        assert type(runner) is mode and isinstance(runner, Runner)
        assert runner.costs is costs and runner.forward_passes == 0
        with pytest.raises(AttributeError):  # built whole: nothing sets the costs afterwards
            runner.costs = prior_costs()
    assert cases[0][0].supports_trees and cases[1][0].supports_trees
    assert not cases[3][0].supports_trees and not cases[5][0].supports_trees


def greedy_steps(runner: Runner, rows: list[list[int]], steps: int) -> None:
    """`steps` greedy tokens for every row of `runner`, whose cache holds each row but its last token."""
    for _ in range(steps):
        logits = runner.forward_rows([(row[-1:], None) for row in rows], [1] * len(rows))
        for row, scores in zip(rows, logits, strict=True):
            row.append(int(scores[-1].argmax()))


@pytest.mark.parametrize("name", ["llama", "mistral", "t5"])
def test_a_batch_down_to_one_row_gives_the_tokens_of_that_row_alone(name, monkeypatch):
    """select_rows([b]) returns the runner to use next: for a shared batch a one-sequence runner over
    the compacted cache, which goes on with the same tokens, the pass count and the one-row timing."""
    model, costs = tiny_model(name), prior_costs()
    timings = []
    monkeypatch.setattr(costs, "observe", lambda k, seconds: timings.append(("one row", k)))
    monkeypatch.setattr(costs, "observe_batch", lambda rows, width, seconds: timings.append(("batch", rows, width)))
    prompts = [prompt(30 + b, length=5 + 4 * b) for b in range(3)]
    encoder = [prompt(40 + b) for b in range(3)] if name == "t5" else None
    starts = [[0] for _ in prompts] if name == "t5" else prompts
    batch = make_runner(model, rows=3, encoder_input_ids=encoder, costs=costs)
    rows = [list(start) for start in starts]
    batch.forward_rows([(row[:-1], None) if len(row) > 1 else ([], None) for row in rows],
                       [int(len(row) > 1) for row in rows])
    greedy_steps(batch, rows, 3)
    passes = batch.forward_passes
    one = batch.select_rows([1])
    assert type(one) is (PerRowRunner if name == "t5" else SequenceRunner)
    assert one.forward_passes == passes and one.costs is costs
    timings.clear()
    greedy_steps(one, rows[1:2], 4)
    assert one.forward_passes == passes + 4
    assert timings == [("one row", 0)] * 4  # a one-row pass after the prefill, timed in the one-row table
    alone = make_runner(model, encoder_input_ids=None if encoder is None else encoder[1:2])
    reference = list(starts[1])
    if len(reference) > 1:
        alone.forward(reference[:-1])
    greedy_steps(alone, [reference], 7)
    assert rows[1] == reference
    if name != "t5":
        assert one.row_length(0) == len(one.tokens) == len(reference) - 1 and one._cache.get_seq_length() == len(one.tokens)


def test_a_shared_batch_times_its_passes_in_the_batch_table(monkeypatch):
    model, costs = tiny_model("llama"), prior_costs()
    timings = []
    monkeypatch.setattr(costs, "observe", lambda k, seconds: timings.append(("one row", k)))
    monkeypatch.setattr(costs, "observe_batch", lambda rows, width, seconds: timings.append(("batch", rows, width)))
    batch = make_runner(model, rows=2, costs=costs)
    batch.forward_rows([(prompt(1, length=6), None), (prompt(2, length=9), None)], [1, 1])
    assert timings == [] and batch.forward_passes == 2  # the prompts: a pass each, untimed
    logits = batch.forward_rows([([4, 5, 6], None), ([7], None)], [3, 1])
    assert timings == [("batch", 2, 3)] and batch.forward_passes == 3
    assert [tuple(row.shape) for row in logits] == [(3, VOCAB), (1, VOCAB)]
