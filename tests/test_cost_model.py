"""The measured cost model and the draft policy built on it: fake clocks, no timing in tests."""

from __future__ import annotations

import copy

import pytest
import torch

from sampling.policy.draft_policy import CostAwareDraftLength, best_draft_length
from tests.models import tiny_model
from utils import calibration, cost_model
from utils.calibration import calibrate, pass_costs
from utils.cost_model import DRAFT_SIZES, PassCosts, prior_cost
from utils.cpu_passes import Shortcuts
from utils.machine import calibration_key

NONE, LINEAR = Shortcuts(), Shortcuts(few_row_linear=True)


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """Every test here runs as on a quiet machine, whatever else runs on it (tests/test_calibration_load.py
    tests the busy case), and as in a fresh process."""
    monkeypatch.setattr(calibration, "_scheduler_times", lambda: (0.0, 0.0))
    monkeypatch.setattr(calibration, "_busy_seen", False)
    monkeypatch.setattr(calibration, "_DROPPED", set())


def fake_timings(seconds_of, spread: float = 0.0):
    """A stand-in for calibration.time_passes: seconds_of(k, choice) for every pass, repeats varied by `spread`."""

    def timings(model, choices, repeats, watch=None):
        return {(k, choice): [seconds_of(k, choice) * (1 + spread * i) for i in range(repeats)]
                for k in (0, *DRAFT_SIZES) for choice in choices}

    return timings


def test_calibration_picks_the_faster_kernel_for_each_size(monkeypatch):
    # The few-row linear is slower for k < 4 on this pretend CPU and faster from there on.
    def seconds(k, choice):
        base = 1.0 + 0.05 * k
        return base * (0.8 if k >= 4 else 1.5) if choice.few_row_linear else base

    monkeypatch.setattr(calibration, "time_passes", fake_timings(seconds))
    monkeypatch.setattr(calibration.cpu_passes, "available_shortcuts", lambda model: [NONE, LINEAR])
    costs, spread = calibrate(tiny_model("gpt2"))  # the Hugging Face path (our own forward chose its kernels)
    assert spread == 0.0 and costs.measured
    assert costs.shortcuts_for(2) == NONE and costs.shortcuts_for(4) == LINEAR and costs.shortcuts_for(5) == LINEAR
    assert costs(1) == pytest.approx(1.05)
    assert costs(4) == pytest.approx(max(1.2 * 0.8, costs(3)))  # never cheaper than a shorter pass
    assert costs.shortcuts_for(0) == NONE


def test_a_noisy_calibration_is_not_cached_and_a_clean_one_is(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    model = copy.deepcopy(tiny_model("qwen2"))
    monkeypatch.setattr(calibration, "time_passes", fake_timings(lambda k, c: 1.0 + k / 10, spread=0.5))
    costs = pass_costs(model)
    assert not costs.measured and costs(8) == prior_cost(8)  # a burst: the prior, online refinement takes over
    assert not list(tmp_path.rglob("*.json"))

    del calibration._COSTS[model]  # a new process: measured again
    calibration._DROPPED.clear()
    monkeypatch.setattr(calibration, "time_passes", fake_timings(lambda k, c: 1.0 + k / 10))
    costs = pass_costs(model)
    assert costs.measured and costs(8) == pytest.approx(1.8)
    assert len(list(tmp_path.rglob("*.json"))) == 1

    del calibration._COSTS[model]  # a new process: read from disk, nothing measured

    def no_timing(*args):
        raise AssertionError("measured again")

    monkeypatch.setattr(calibration, "time_passes", no_timing)
    assert pass_costs(model).relative == costs.relative
    assert pass_costs(model) is pass_costs(model)  # one object per model: online refinement is shared


def test_the_cache_key_changes_with_dtype_threads_and_kernels():
    model = tiny_model("llama")
    key = calibration_key(model)
    assert calibration_key(copy.deepcopy(model).float())["dtype"] != key["dtype"]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert calibration_key(model) != key
    finally:
        torch.set_num_threads(threads)
    assert calibration_key(model) == key
    assert {"cpu", "cpu_capability", "torch", "transformers", "kernels", "attention", "device"} <= set(key)


def test_calibration_off_uses_the_prior(monkeypatch):
    monkeypatch.setenv("SPECDEC_CALIBRATE", "0")
    model = copy.deepcopy(tiny_model("gpt2"))
    costs = pass_costs(model)
    assert not costs.measured and costs(2) == prior_cost(2) and costs.shortcuts_for(4) == NONE


def test_a_real_calibration_measures_every_size():
    # Real passes on the suite's one thread (tests/conftest.py): the table's shape does not depend on the count.
    costs, spread = calibrate(tiny_model("gpt2"), repeats=1)
    assert set(costs.relative) == {0, *DRAFT_SIZES} and costs.one_token_seconds > 0 and spread >= 0
    assert all(costs(k) >= 1.0 for k in DRAFT_SIZES)


def test_online_observations_replace_the_calibration_and_a_burst_moves_little():
    costs = PassCosts(relative={0: 1.0, 1: 2.0, 31: 4.0}, one_token_seconds=0.1, measured=True)
    costs.observe(0, 0.5)  # each width's first pass is a warm-up: not a cost
    costs.observe(1, 0.5)
    assert costs.seconds(0) == pytest.approx(0.1) and costs(1) == pytest.approx(2.0)
    for _ in range(2):
        costs.observe(0, 0.1)
        costs.observe(1, 0.11)
    assert costs.seconds(0) == pytest.approx(0.1) and costs(1) == pytest.approx(2.0)  # two timings: not yet
    costs.observe(0, 0.1)
    costs.observe(1, 0.11)
    assert costs(1) == pytest.approx(1.1)  # measured where it runs now, not at calibration time
    assert costs(2) == pytest.approx(2.0 + 2 / 30)  # never observed: still the calibration
    costs.observe(1, 100.0)  # one pass during a burst of load
    assert costs(1) < 1.1 * 1.11


# The policy


def test_draft_length_pays_for_itself():
    assert best_draft_length([0.03, 0.03], prior_cost) == 0  # unsure: a plain step is cheaper
    assert best_draft_length([0.95] * 8, prior_cost) == 8
    assert best_draft_length([0.9, 0.9, 0.05], prior_cost) == 2
    expensive = {0: 1.0, 1: 1.9, 2: 1.95, 4: 2.0, 8: 2.1, 16: 2.5, 32: 3.0}  # the first extra token is dear
    assert best_draft_length([0.5] * 8, lambda k: cost_model._interpolate(expensive, k)) == 0
    assert best_draft_length([0.9] * 8, lambda k: cost_model._interpolate(expensive, k)) == 8


def test_a_model_drafter_that_cannot_pay_stops_drafting_and_probes_later():
    target = PassCosts(one_token_seconds=1.0, relative={0: 1.0, 1: 1.1, 16: 2.0, 32: 3.0})
    drafter = PassCosts(one_token_seconds=1.0, relative={0: 1.0, 1: 1.1, 32: 3.0})
    as_slow = CostAwareDraftLength(8, target, drafter)
    middling = CostAwareDraftLength(8, target, drafter, draft_seconds=lambda: 0.3)  # timed drafting steps
    cheap = CostAwareDraftLength(8, target, PassCosts(one_token_seconds=0.05, relative={0: 1.0, 1: 1.1, 32: 3.0}))
    for policy in (as_slow, middling, cheap):
        for _ in range(20):
            policy.update(4, 0)  # the drafts were all wrong
    assert as_slow.budget(1) == 0 and middling.budget(1) == 0 and cheap.budget(1) == 0
    for policy in (as_slow, middling):
        for _ in range(policy.PROBE_AFTER):
            policy.update(0, 0)
    assert as_slow.budget(1) == 0  # as dear as the target: it could not pay even if always right, never probed
    assert middling.budget(1) == 1  # could pay if right: one probe after a run of plain steps
    middling.update(1, 0)
    for _ in range(middling.PROBE_AFTER):
        middling.update(0, 0)
    assert middling.budget(1) == 0  # a probe that found nothing: the next one waits twice as long
    for _ in range(middling.PROBE_AFTER):
        middling.update(0, 0)
    assert middling.budget(1) == 1
    for _ in range(50):
        cheap.update(max(cheap.budget(1), 4), 4)  # the cheap drafter matches again: it drafts
    assert cheap.budget(1) > 2


def test_batched_passes_are_judged_by_their_own_timings():
    costs = PassCosts(relative={0: 1.0, 1: 1.05, 16: 2.0, 32: 3.0}, one_token_seconds=1.0)
    assert costs.batch_ratio(8, 2) == pytest.approx(costs(15) / costs(7))  # untimed: from the one-row table
    for _ in range(3):
        costs.observe_batch(8, 1, 1.0)
        costs.observe_batch(8, 2, 1.9)  # this machine: 8 rows x 2 tokens cost nearly twice 8 x 1
    assert costs.batch_ratio(8, 2) == pytest.approx(1.9)
    assert costs(15) == pytest.approx(1.05 + 14 * 0.95 / 15)  # the one-row table is untouched
