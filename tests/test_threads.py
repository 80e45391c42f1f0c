"""utils/threads.py: the thread count and OpenMP wait policy follow what the other processes hold."""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import torch_threads
from utils import threads
from utils.threads import Fit

read_quota = threads.cpu_quota  # the function itself, for the test of its reading


@pytest.fixture(autouse=True)
def no_quota(monkeypatch):
    """The machine's own CPU quota (a CI container's) out of every test here but those that set one."""
    monkeypatch.setattr(threads, "cpu_quota", lambda: None)


def test_the_cores_are_the_affinitys_and_the_other_load_is_a_share_of_them():
    assert 1 <= threads.available_cores() <= (os.cpu_count() or 1)
    busy = threads.other_load(0.05)
    if busy is not None:  # Linux: measured; elsewhere the load average or nothing
        assert 0.0 <= busy <= threads.available_cores() + 1e-9


def test_the_fit_leaves_the_others_their_cores_and_keeps_one():
    crowded = [Fit(cores=2, busy=1.0, threads=1), Fit(cores=4, busy=2.6, threads=1)]
    assert all(fit.crowded for fit in crowded) and not Fit(cores=2, busy=0.2, threads=2).crowded
    assert threads.advice(2, crowded[0]) is not None and "set_num_threads(1)" in threads.advice(2, crowded[0])
    assert threads.advice(1, crowded[0]) is None  # one thread fits already
    assert threads.advice(2, None) is None and threads.advice(2, Fit(2, 0.1, 2)) is None


def test_measure_rounds_the_free_cores(monkeypatch):
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    for busy, expected in [(0.0, 2), (0.4, 2), (0.9, 1), (1.6, 1), (5.0, 1)]:
        monkeypatch.setattr(threads, "other_load", lambda seconds=0, busy=busy: busy)
        assert threads.measure().threads == expected
    monkeypatch.setattr(threads, "other_load", lambda seconds=0: None)
    assert threads.measure() is None


@pytest.mark.parametrize("user", [{}, {"OMP_NUM_THREADS": "2"}, {"OMP_WAIT_POLICY": "ACTIVE"}])
def test_a_crowded_start_sets_what_the_user_left_unset_and_says_so_in_one_line(monkeypatch, user):
    monkeypatch.setattr(threads, "measure", lambda seconds=0: Fit(cores=2, busy=1.0, threads=1))
    environ = dict(user)
    line = threads.settle_openmp(environ)
    assert environ["OMP_NUM_THREADS"] == user.get("OMP_NUM_THREADS", "1")
    assert environ["OMP_WAIT_POLICY"] == user.get("OMP_WAIT_POLICY", "PASSIVE")
    assert "\n" not in line and "1.0 of 2 cores" in line and "OMP_NUM_THREADS" in line


def test_a_quiet_start_or_a_users_choice_changes_nothing(monkeypatch):
    monkeypatch.setattr(threads, "measure", lambda seconds=0: Fit(cores=2, busy=0.1, threads=2))
    environ: dict = {}
    assert threads.settle_openmp(environ) is None and environ == {}
    monkeypatch.setattr(threads, "measure", lambda seconds=0: pytest.fail("measured though the user chose"))
    chosen = {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "ACTIVE"}
    assert threads.settle_openmp(chosen) is None and chosen == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "ACTIVE"}


def test_fit_threads_only_lowers_torchs_threads():
    with torch_threads(2):
        line = threads.fit_threads(Fit(cores=2, busy=1.0, threads=1))
        assert torch.get_num_threads() == 1 and "instead of 2" in line
    assert threads.fit_threads(Fit(cores=2, busy=1.0, threads=1)) is None  # one already
    assert threads.fit_threads(Fit(cores=2, busy=0.0, threads=2)) is None and torch.get_num_threads() == 1


def test_the_fair_share_follows_the_other_processes_between_passes_and_gives_the_users_count_back(monkeypatch):
    """Readings of (busy ticks, all ticks, our ticks) a window apart: another process on one of 2 cores takes torch to 1
    thread, then its end gives the user's 2 back; a count the user sets meanwhile becomes the one to give back."""
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    readings = iter([(0, 0, 0), (200, 200, 100), (300, 400, 100), (400, 600, 200)])  # others: 1 core, 1, 0
    clock = iter(range(0, 100, 1))
    monkeypatch.setattr(threads.time, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(threads.FairShare, "_reading", staticmethod(lambda now: (now, *next(readings))))
    watch = threads.FairShare(seconds=0.5)
    with torch_threads(2):
        watch()  # the first reading: nothing to compare with yet
        assert torch.get_num_threads() == 2
        watch()
        assert torch.get_num_threads() == 1
        watch()  # (300 - 200 - 0) / 200 of 2 cores: one core's worth still busy
        assert torch.get_num_threads() == 1
        watch()  # (100 - 100) / 200: free again
        assert torch.get_num_threads() == 2


def test_a_window_over_a_pause_between_generations_decides_nothing(monkeypatch):
    """Another process busy while this one paused (our ticks: none over 10 s) must not cost the next generation a
    thread: the window after it decides, and it is quiet."""
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    readings = iter([(0, 0, 0), (1000, 2000, 0), (1100, 2100, 100)])  # others: 1 core over the pause, then none
    clock = iter([0.0, 10.0, 11.0])
    monkeypatch.setattr(threads.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(threads.FairShare, "_reading", staticmethod(lambda now: (now, *next(readings))))
    watch = threads.FairShare(seconds=0.5)
    with torch_threads(2):
        watch()
        watch()  # after the pause: 1000 of 2000 ticks the others', none ours
        assert torch.get_num_threads() == 2
        watch()  # our pass alone on the cores
        assert torch.get_num_threads() == 2


def test_the_fair_share_reads_the_machine_at_most_once_a_window(monkeypatch):
    calls = []
    monkeypatch.setattr(threads.FairShare, "_reading", staticmethod(lambda now: calls.append(now)))
    watch = threads.FairShare(seconds=60.0)
    for _ in range(100):
        watch()
    assert len(calls) == 1


def test_loading_a_model_takes_the_watchers_first_reading(tmp_path, monkeypatch):
    """So that the first pass (the prompt's, the longest) already runs on the fair share beside a busy process."""
    from tests.saved_model import save_tiny_chat_model
    from utils.loading import load_model

    calls = []
    monkeypatch.setattr(threads, "fair_share", lambda: calls.append(1))
    load_model(str(save_tiny_chat_model(tmp_path / "model")))
    assert calls == [1]


def _group(root, path: str, files: dict[str, str]) -> None:
    folder = root.joinpath(*[part for part in path.split("/") if part])
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def test_a_cpu_quota_is_read_from_the_tightest_group_up_to_the_root_in_cgroup_v1_and_v2(tmp_path):
    """v2: `cpu.max` ("max" for none), the parent's limit binding a child without one; v1: the cpu controller's
    folder (joined with cpuacct or not), quota over period, -1 for none; no group, or no file to read: None."""
    v2, membership = tmp_path / "v2", tmp_path / "cgroup"
    _group(v2, "/", {"cpu.max": "max 100000\n"})
    _group(v2, "/kubepods/pod1", {"cpu.max": "250000 100000\n"})
    _group(v2, "/kubepods/pod1/app", {"cpu.max": "max 100000\n"})
    membership.write_text("0::/kubepods/pod1/app\n")
    assert read_quota(str(v2), str(membership)) == 2.5
    _group(v2, "/kubepods/pod1/app", {"cpu.max": "50000 100000\n"})
    assert read_quota(str(v2), str(membership)) == 0.5
    _group(v2, "/kubepods/pod1", {"cpu.max": "max 100000\n"})
    _group(v2, "/kubepods/pod1/app", {"cpu.max": "max 100000\n"})
    assert read_quota(str(v2), str(membership)) is None

    v1 = tmp_path / "v1"
    _group(v1 / "cpu,cpuacct", "/", {"cpu.cfs_quota_us": "-1\n", "cpu.cfs_period_us": "100000\n"})
    _group(v1 / "cpu,cpuacct", "/docker/abc", {"cpu.cfs_quota_us": "150000\n", "cpu.cfs_period_us": "100000\n"})
    _group(v1 / "memory", "/docker/abc", {"cpu.cfs_quota_us": "10000\n", "cpu.cfs_period_us": "100000\n"})
    membership.write_text("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    assert read_quota(str(v1), str(membership)) == 1.5  # the memory controller's folder is not read
    membership.write_text("3:cpu,cpuacct:/docker/other\n")  # a host's path the container's mount does not hold
    assert read_quota(str(v1), str(membership)) is None
    _group(v1 / "cpu,cpuacct", "/", {"cpu.cfs_quota_us": "200000\n", "cpu.cfs_period_us": "100000\n"})
    assert read_quota(str(v1), str(membership)) == 2.0  # the container's own group, the mount's root
    assert read_quota(str(v1), str(tmp_path / "absent")) is None


@pytest.mark.parametrize("quota, cores, expected", [(None, 4, 4), (1.5, 2, 1), (0.3, 2, 1), (2.0, 2, 2), (8.0, 4, 4)])
def test_the_threads_keep_to_a_quotas_whole_cores(monkeypatch, quota, cores, expected):
    monkeypatch.setattr(threads, "cpu_quota", lambda: quota)
    monkeypatch.setattr(threads, "available_cores", lambda: cores)
    assert threads.thread_limit() == expected
    monkeypatch.setattr(threads, "other_load", lambda seconds=0: 0.0)
    fit = threads.measure()
    assert fit.threads == expected and fit.capped == (expected < cores) and not fit.crowded


def test_a_quota_takes_torch_to_its_cores_at_the_first_call_and_the_console_says_so(monkeypatch):
    monkeypatch.setattr(threads, "cpu_quota", lambda: 1.0)
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    monkeypatch.setattr(threads, "other_load", lambda seconds=0: 0.0)
    monkeypatch.setattr(threads.FairShare, "_reading", staticmethod(lambda now: None))
    with torch_threads(2):
        threads.FairShare(seconds=0.5)()
        assert torch.get_num_threads() == 1
    environ: dict = {}
    line = threads.settle_openmp(environ)
    assert environ == {"OMP_NUM_THREADS": "1"} and "\n" not in line and "quota allows 1 of 2 cores" in line
    assert threads.settle_openmp({"OMP_NUM_THREADS": "2"}) is None  # the user's count: nothing to say
    said = threads.advice(2, threads.measure())
    assert "set_num_threads(1)" in said and "PASSIVE" not in said  # a quota alone: the thread count, no wait policy
