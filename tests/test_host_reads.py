"""Host reads per step (issues 47, 52): every `Tensor.item`/`tolist`/`cpu`/`numpy` and every tensor made a
Python bool, int, float or index is counted while a method decodes on a tiny model; a step is one
verification pass of the loop (plain decoding: one token). On a CPU a read costs little; on an
accelerator each one waits for the queued work, so the figures are held here.

Measured when this test was written (greedy unless said; 24 new tokens, gamma 5, a random drafter):
plain 1.0, NASD 2.1, SD 5.5, SD sampled 9.9, model trees 10.4, sampled model trees 46.8 (41.8 once
their acceptance read the walk's verdicts in one transfer), a batch of three rows with a drafter
model 30.3. Measured since a drafter model's chain keeps its drafts on the device and reads them
once a step (issue 52): NASD 2.0, SD 1.96, SD sampled 1.95, the batch 2.0 (the step's drafts, then
the acceptance's verdict; the batch's figure includes one read a generation, its rows' seeds),
model trees 3.75, sampled model trees 6.7 (a tree reads once per drafter pass, twice when sampled,
to choose what the next pass expands: docs/architecture.md, "Host reads"). The ceilings below hold
these figures. Trees grown on the device (where a read waits for it; tests/test_device_trees.py) read 2 a step:
greedy 1.96, sampled 2.07, drafter-invariant 1.95, a batch 2.0, a sampled batch 2.11 (one read a generation per
row included: its seeds' numbers); since then every row's sampled-tree verdicts are read in one transfer
(a sampled batch of host-grown trees 8.76 -> 6.82).
"""

import pytest
import torch

from ngram_assisted import MultiDynaGram, ngram_assisted_speculative_generate
from sampling import autoregressive_generate, speculative_generate
from tests.models import prompt, tiny_model
from utils.logits_processors import MultinomialProcessor

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
ROWS = [prompt(0, length=6) * 2, prompt(1, length=5) * 2, prompt(2, length=7)]


class Steps:
    """A fixed budget of `gamma` nodes, counting the loop's steps (it is asked once per step)."""

    def __init__(self, gamma: int) -> None:
        self.gamma, self.steps = gamma, 0

    def budget(self, num_rows: int) -> int:
        self.steps += 1
        return self.gamma

    def update(self, num_drafts: int, num_accepted: int) -> None:
        pass


def count_reads(run) -> int:
    """Host reads while `run()` runs; the test's other patches stay as they are."""
    count, originals = [0], {name: getattr(torch.Tensor, name) for name in READS}

    def counted_as(original):
        def counted(self, *args, **kwargs):
            count[0] += 1
            return original(self, *args, **kwargs)
        return counted

    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, counted_as(original))
        run()
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return count[0]


def sampled():
    return {"logits_processor": MultinomialProcessor(temperature=1.0), "generator": torch.Generator().manual_seed(0)}


CASES = {  # method -> (run with a counting policy, ceiling of reads per step)
    "nasd": (lambda t, d, p: ngram_assisted_speculative_generate(ROWS[0], MultiDynaGram(2), t, gamma=5, max_gen_len=24,
                                                                 draft_policy=p), 2.0),
    "sd": (lambda t, d, p: speculative_generate(ROWS[0], d, t, max_gen_len=24, draft_policy=p), 2.0),
    "sd sampled": (lambda t, d, p: speculative_generate(ROWS[0], d, t, max_gen_len=24, draft_policy=p, **sampled()), 2.0),
    "trees": (lambda t, d, p: speculative_generate(ROWS[0], d, t, max_gen_len=24, branching=3, draft_policy=p), 4.0),
    "trees sampled": (lambda t, d, p: speculative_generate(ROWS[0], d, t, max_gen_len=24, branching=3, draft_policy=p,
                                                           **sampled()), 7.0),
    "batch sd": (lambda t, d, p: speculative_generate(ROWS, d, t, max_gen_len=24, draft_policy=p), 2.0),
}


def test_plain_decoding_reads_the_host_once_a_token():
    target = tiny_model("llama")
    autoregressive_generate(ROWS[0], target, max_gen_len=24)  # calibrated before counting
    reads = count_reads(lambda: autoregressive_generate(ROWS[0], target, max_gen_len=24, end_tokens_id=None))
    assert reads <= 24


@pytest.mark.parametrize("method", sorted(CASES))
def test_host_reads_per_step_stay_within_their_ceiling(method):
    target, drafter = tiny_model("llama"), tiny_model("llama", seed=1)
    run, ceiling = CASES[method]
    run(target, drafter, Steps(5))  # calibrated before counting
    policy = Steps(5)
    reads = count_reads(lambda: run(target, drafter, policy))
    assert policy.steps > 0
    assert reads / policy.steps <= ceiling, f"{method}: {reads} host reads in {policy.steps} steps"
