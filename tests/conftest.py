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
os.environ["SPECDEC_COMPILE"] = "0"  # load_model(compile="auto") compiles nothing here: the tests that compile say so

import torch  # noqa: E402

torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import models  # noqa: E402

models.tiny_model = lru_cache(maxsize=None)(models.tiny_model)  # tests only read the models

# Calibrations (utils/calibration.py) of the tiny models go to a fresh folder, not the user's cache
# (tests/test_examples.py runs the built-in model with the user's cache, as the README does).
USER_CACHE = os.environ.get("SPECDEC_CACHE")
os.environ["SPECDEC_CACHE"] = tempfile.mkdtemp(prefix="specdec-tests-")


@contextmanager
def torch_threads(count: int):
    """torch on `count` threads inside the block, one thread again after."""
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(1)
