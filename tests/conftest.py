import os
import sys
import tempfile
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

# One thread for torch, in this process and in every process a test starts (the console, the notebook's
# kernel, the benchmarks): set before torch is imported, so that OpenMP starts with one thread. A tiny
# model gains nothing from a second thread, and beside another busy process torch's second OpenMP thread
# spin-waits for a core the other holds (tests/test_ngram_assisted.py, 2 cores: 21.7 s quiet and 65.5 s
# beside one busy loop with two threads; 21.1 s and 20.3 s with one). The tests that time real passes
# say which thread count they run with (`torch_threads`).
os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import models  # noqa: E402

models.tiny_model = lru_cache(maxsize=None)(models.tiny_model)  # tests only read the models


@pytest.fixture(autouse=True)
def _drafts_judged_from_the_prior():
    """Each test's first generation starts from the priors: what a pair of models learns (the per-token stop's odds,
    the chains' record) is kept across generations (`pair_record`), and the tests share their tiny models."""
    from sampling.policy.draft_confidence import forget_pair_records

    forget_pair_records()


# Calibrations (utils/calibration.py) of the tiny models go to a fresh folder, not the user's cache
# (tests/test_examples.py runs the built-in model with the user's cache, as the README does). pytest-xdist's workers
# inherit the controller's environment, its fresh folder included: the user's own setting ("" for the default
# folder) travels to them in USER_CACHE_ENV, else each `make test` converted and calibrated the built-in model anew.
USER_CACHE_ENV = "SPECDEC_TESTS_USER_CACHE"
os.environ.setdefault(USER_CACHE_ENV, os.environ.get("SPECDEC_CACHE", ""))
USER_CACHE = os.environ[USER_CACHE_ENV] or None
os.environ["SPECDEC_CACHE"] = tempfile.mkdtemp(prefix="specdec-tests-")


REQUIRE_NATIVE_ENV = "SPECDEC_REQUIRE_NATIVE"  # "1" (CI, .ci/run): a test of our native kernels fails where they cannot run


def missing_native(reason: str) -> None:
    """Skip the calling test, saying `reason` (what our native kernels or a toolchain they are tested with lack here: a
    visible skip, not a silent pass); under `SPECDEC_REQUIRE_NATIVE=1` fail it instead (a machine that must have
    them: CI)."""
    if os.environ.get(REQUIRE_NATIVE_ENV) == "1":
        pytest.fail(f"{reason}, and {REQUIRE_NATIVE_ENV}=1 requires it")
    pytest.skip(reason)


def require_native() -> None:
    """`missing_native` with the reason `native.unavailable()` gives, where our native kernels cannot run here."""
    from utils.lean import native

    reason = native.unavailable()
    if reason is not None:
        missing_native(f"our native kernels cannot run here: {reason}")


@pytest.fixture
def requires_native() -> None:
    """`require_native` as a fixture: the test runs only where our native kernels do."""
    require_native()


@contextmanager
def torch_threads(count: int):
    """torch on `count` threads inside the block, one thread again after."""
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(1)


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (make test): one worker per core this process may run on, each on one torch thread
    (above); pytest-xdist's own count would be the physical cores, one on a 2-vCPU machine."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the xdist_group markers
def pytest_collection_modifyitems(config, items) -> None:
    """The terminal tests (marked `subprocess`) and the ones that time the machine (marked `serial`) run one
    after another on one worker under `--dist loadgroup` (`make test`): a console waiting on its prompt or a
    calibration filling every core is not the place for a second one beside it. Without xdist: no effect."""
    for item in items:
        if item.get_closest_marker("subprocess") or item.get_closest_marker("serial"):
            item.add_marker(pytest.mark.xdist_group("serial"))
        group = item.get_closest_marker("xdist_group")
        if group is not None and getattr(config.option, "loadgroup", False):  # set on xdist's workers only
            _join_group(item, group.args[0])
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker collects alike, so every worker sorts alike
        items.sort(key=_longest_first)


def _join_group(item, group: str) -> None:
    """Give `item` the id `--dist loadgroup` schedules by ("<id>@<group>"). pytest-xdist 3.8 writes it to
    `item._nodeid`, which pytest 9.2 no longer reads (its id lives in `item._id`): without this, every group
    is silently split over the workers."""
    nodeid = f"{item.nodeid}@{group}"
    if hasattr(item, "_id"):
        item._id = type(item._id).parse(nodeid)
    else:
        item._nodeid = nodeid


def _longest_first(item) -> int:
    """Under xdist, the long units start first (longest-processing-time first: no long test left for the end
    while the other worker idles): the built-in model's group (the notebook tour, the README snippet), the
    serial group, the slow tests, then the rest in their order."""
    group = item.get_closest_marker("xdist_group")
    if group is not None:
        return 0 if group.args[0] == "built-in model" else 1
    return 2 if item.get_closest_marker("slow") else 3
