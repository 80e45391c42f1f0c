import os
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import models  # noqa: E402

models.tiny_model = lru_cache(maxsize=None)(models.tiny_model)  # tests only read the models

# Calibrations (utils/cost_model.py) and converted models go to a fresh folder, not the user's cache.
os.environ["SPECDEC_CACHE"] = tempfile.mkdtemp(prefix="specdec-tests-")
