"""A calibration never stores a busy machine's table (utils/calibration.py, point 3 of its docstring),
gives up at once, and a stored table that the online timings contradict is measured again."""

from __future__ import annotations

import copy
import math
import multiprocessing
import os
import time

import pytest

from tests.conftest import torch_threads
from tests.models import tiny_model
from utils import calibration
from utils.calibration import is_measured, pass_costs
from utils.cost_model import STALE_AFTER, STALE_MIN, PassCosts, prior_cost


@pytest.fixture
def fresh_process(monkeypatch, tmp_path):
    """An empty calibration cache and a process that has given up on nothing yet."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration, "_busy_seen", False)
    monkeypatch.setattr(calibration, "_DROPPED", set())
    monkeypatch.setattr(calibration, "_told", False)
    return tmp_path


def no_timing(*args):
    raise AssertionError("measured again")


def told(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("specdec:")]


def _spin() -> None:
    while True:
        pass


@pytest.mark.serial  # fills every core with busy loops: nothing else beside it (tests/conftest.py)
@pytest.mark.skipif(calibration._scheduler_times() is None, reason="the kernel does not count run-queue waits here")
def test_a_calibration_under_load_is_not_cached_and_returns_within_a_minute(fresh_process, capsys):
    cores = max(2, len(os.sched_getaffinity(0)))
    spinners = [multiprocessing.get_context("fork").Process(target=_spin, daemon=True) for _ in range(cores)]
    for spinner in spinners:  # every core this process may use kept busy by another process
        spinner.start()
    try:
        time.sleep(0.2)
        start = time.perf_counter()
        with torch_threads(cores):  # a user's process: a thread per core, each meeting a busy loop (the suite runs on one)
            costs = pass_costs(copy.deepcopy(tiny_model("llama")))
        seconds = time.perf_counter() - start
    finally:
        for spinner in spinners:
            spinner.terminate()
            spinner.join()
    assert seconds < 60  # before: 123 s, and cached
    assert not costs.measured and costs(8) == prior_cost(8)
    assert not list(fresh_process.rglob("*.json"))
    assert len(told(capsys)) == 1


def test_a_busy_machine_stops_the_calibration_and_every_later_one_in_the_process(fresh_process, monkeypatch, capsys):
    monkeypatch.setattr(calibration, "_scheduler_times", lambda: (time.perf_counter(),) * 2)  # waited half the time
    monkeypatch.setattr(calibration, "BUSY_AFTER", 0.0)  # a tiny model's whole calibration takes under a second
    passes = []
    real_forward = calibration.SequenceRunner.forward
    monkeypatch.setattr(calibration.SequenceRunner, "forward", lambda self, *a, **k: passes.append(1) or real_forward(self, *a, **k))
    model = copy.deepcopy(tiny_model("qwen2"))
    assert not is_measured(model)
    costs = pass_costs(model)
    assert not costs.measured and not list(fresh_process.rglob("*.json"))
    warm_up_round = (1 + len(calibration.DRAFT_SIZES)) * len(calibration.cpu_passes.available_shortcuts(model))
    assert len(passes) < warm_up_round  # stopped at once, not finished
    # The same model again, another model: nothing measured in this process, and nothing said twice.
    monkeypatch.setattr(calibration, "time_passes", no_timing)
    other = copy.deepcopy(tiny_model("gpt2"))
    assert is_measured(other)
    assert not pass_costs(other).measured
    del calibration._COSTS[model]
    assert not pass_costs(model).measured
    lines = told(capsys)
    assert len(lines) == 1 and "busy" in lines[0]


def test_without_the_kernels_count_a_loaded_machine_is_not_measured(fresh_process, monkeypatch, capsys):
    monkeypatch.setattr(calibration, "_scheduler_times", lambda: None)  # macOS, say
    monkeypatch.setattr(calibration.os, "getloadavg", lambda: (4.0 * (calibration.os.cpu_count() or 1), 0.0, 0.0))
    monkeypatch.setattr(calibration, "time_passes", no_timing)  # gives up before the first pass
    costs = pass_costs(copy.deepcopy(tiny_model("llama")))
    assert not costs.measured and not list(fresh_process.rglob("*.json"))
    assert len(told(capsys)) == 1


def test_a_quiet_calibration_is_cached(fresh_process, monkeypatch):
    monkeypatch.setattr(calibration, "_scheduler_times", lambda: (0.0, 0.0))  # quiet, whatever else runs on the test machine
    monkeypatch.setattr(calibration, "REPEATS", 1)
    monkeypatch.setattr(calibration, "MAX_SPREAD", math.inf)  # the real timings of a shared machine vary
    costs = pass_costs(copy.deepcopy(tiny_model("gpt2")))
    assert costs.measured and costs.spread is not None and costs.on_stale is not None
    assert len(list(fresh_process.rglob("*.json"))) == 1


def fake_timings(seconds_of, spread: float = 0.0):
    def timings(model, choices, repeats, watch=None):
        return {(k, choice): [seconds_of(k) * (1 + spread * i) for i in range(repeats)]
                for k in (0, *calibration.DRAFT_SIZES) for choice in choices}

    return timings


def test_a_noisy_calibration_is_not_repeated_in_the_same_process(fresh_process, monkeypatch, capsys):
    monkeypatch.setattr(calibration, "_scheduler_times", lambda: (0.0, 0.0))
    monkeypatch.setattr(calibration, "time_passes", fake_timings(lambda k: 1.0 + k / 10, spread=0.5))
    model = copy.deepcopy(tiny_model("llama"))
    assert not pass_costs(model).measured
    monkeypatch.setattr(calibration, "time_passes", no_timing)
    twin = copy.deepcopy(model)  # the same key: given up on already
    assert is_measured(twin) and not pass_costs(twin).measured
    assert not list(fresh_process.rglob("*.json"))
    assert len(told(capsys)) == 1


def warm_up(costs, *widths) -> None:
    """Each width's first pass: a warm-up, never counted (`PassCosts.observe`)."""
    for k in widths:
        costs.observe(k, 100.0)


def test_a_stored_table_that_online_timings_contradict_is_measured_again(fresh_process, monkeypatch):
    monkeypatch.setattr(calibration, "_scheduler_times", lambda: (0.0, 0.0))
    monkeypatch.setattr(calibration, "time_passes", fake_timings(lambda k: 1.0 + k / 10))  # k = 8: 1.8x
    model = copy.deepcopy(tiny_model("llama"))
    pass_costs(model)
    (stored,) = fresh_process.rglob("*.json")
    monkeypatch.setattr(calibration, "time_passes", no_timing)

    del calibration._COSTS[model]  # a later start: read from disk; these passes agree with it
    costs = pass_costs(model)
    warm_up(costs, 0, 8)
    for _ in range(2 * STALE_AFTER):
        costs.observe(0, 0.010)
        costs.observe(8, 0.019)
    assert not costs.stale and stored.exists()

    del calibration._COSTS[model]  # another start, on a machine whose wide passes cost nothing extra
    costs = pass_costs(model)
    warm_up(costs, 0, 8)
    for _ in range(STALE_AFTER - 1):
        costs.observe(0, 0.010)
        costs.observe(8, 0.010)
    assert not costs.stale and stored.exists()  # not on a few passes
    costs.observe(0, 0.010)
    costs.observe(8, 0.010)
    assert costs.stale and not stored.exists()
    assert costs(8) == pytest.approx(1.0)  # this run follows the timings already
    del calibration._COSTS[model]
    monkeypatch.setattr(calibration, "time_passes", fake_timings(lambda k: 1.0))
    assert pass_costs(model).measured and stored.exists()  # the next start measured again


def test_the_tolerance_is_the_tables_own_spread():
    def checked(spread):
        costs = PassCosts(relative={0: 1.0, 8: 4.0, 31: 8.0}, one_token_seconds=1.0, measured=True, spread=spread)
        warm_up(costs, 0, 8)
        for _ in range(STALE_AFTER):
            costs.observe(0, 1.0)
            costs.observe(8, 2.0)  # half the table's 4.0
        return costs.stale

    assert checked(STALE_MIN) and not checked(1.5)  # 2x off: wrong for a tight table, within a wide one's spread
    prior = PassCosts(relative={0: 1.0, 8: 4.0, 31: 8.0}, one_token_seconds=None)
    for _ in range(STALE_AFTER):
        prior.observe(0, 1.0)
        prior.observe(8, 1.0)
    assert not prior.stale  # a prior is no measurement to contradict


def busy_start(monkeypatch):
    """A calibration that meets a busy machine at once."""
    monkeypatch.setattr(calibration, "_scheduler_times", lambda: (time.perf_counter(),) * 2)
    monkeypatch.setattr(calibration, "BUSY_AFTER", 0.0)


def next_start(monkeypatch):
    """A new process: nothing given up in memory, nothing said yet."""
    monkeypatch.setattr(calibration, "_busy_seen", False)
    monkeypatch.setattr(calibration, "_told", False)
    calibration._COSTS.clear()


def test_a_busy_start_is_not_retried_at_every_start_and_says_so_once(fresh_process, monkeypatch, capsys):
    busy_start(monkeypatch)
    model = copy.deepcopy(tiny_model("llama"))
    assert not pass_costs(model).measured
    (note,) = fresh_process.rglob("*.busy")  # the attempt and its time, not a table
    assert not list(fresh_process.rglob("*.json"))
    assert "busy" in told(capsys)[0]
    for _ in range(2):  # later starts within BACK_OFF: the prior at once, one line each
        next_start(monkeypatch)
        monkeypatch.setattr(calibration, "time_passes", no_timing)
        assert is_measured(model) and not pass_costs(model).measured
        lines = told(capsys)
        assert len(lines) == 1 and "min ago" in lines[0] and "SPECDEC_CALIBRATE=1" in lines[0]
    next_start(monkeypatch)
    monkeypatch.setattr(calibration, "time_passes", fake_timings(lambda k: 1.0 + k / 10))
    monkeypatch.setattr(calibration, "_scheduler_times", lambda: (0.0, 0.0))  # quiet now
    monkeypatch.setattr(calibration, "BACK_OFF", 0.0)  # ... and the back-off is over
    assert not is_measured(model) and pass_costs(model).measured
    assert len(list(fresh_process.rglob("*.json"))) == 1 and not note.exists()


def test_a_forced_calibration_measures_through_the_back_off(fresh_process, monkeypatch):
    busy_start(monkeypatch)
    model = copy.deepcopy(tiny_model("gpt2"))
    pass_costs(model)
    next_start(monkeypatch)
    monkeypatch.setattr(calibration, "_scheduler_times", lambda: (0.0, 0.0))
    monkeypatch.setattr(calibration, "time_passes", fake_timings(lambda k: 1.0))
    monkeypatch.setenv(calibration.CALIBRATE_ENV, "1")
    assert pass_costs(model).measured


def test_the_busy_line_says_what_to_set_when_the_threads_do_not_fit(fresh_process, monkeypatch, capsys):
    busy_start(monkeypatch)
    # The passes' own fair share (`threads.fair_share`) would lower torch's threads first where this machine is busy
    # now (the suite's other worker): then nothing is left to advise. Here the threads stay as set.
    monkeypatch.setattr(calibration.threads, "fair_share", lambda: None)
    monkeypatch.setattr(calibration.threads, "measure", lambda: calibration.threads.Fit(cores=2, busy=1.0, threads=1))
    with torch_threads(2):
        pass_costs(copy.deepcopy(tiny_model("llama")))
    (line,) = told(capsys)
    assert "torch.set_num_threads(1)" in line and "OMP_WAIT_POLICY=PASSIVE" in line
