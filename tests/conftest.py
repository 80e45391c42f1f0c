import os
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import models  # noqa: E402

models.tiny_model = lru_cache(maxsize=None)(models.tiny_model)  # tests only read the models

# Calibrations (utils/calibration.py) of the tiny models go to a fresh folder, not the user's cache
# (tests/test_examples.py runs the built-in model with the user's cache, as the README does).
USER_CACHE = os.environ.get("SPECDEC_CACHE")
os.environ["SPECDEC_CACHE"] = tempfile.mkdtemp(prefix="specdec-tests-")
