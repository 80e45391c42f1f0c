"""What `pip install` puts on a user's path: the library's three packages and nothing else. The console
(infer.py, console/) and the benchmarks run from the repository's root (tests/test_console.py starts
infer.py there, tests/test_benchmark.py `python -m benchmarks.spec_bench`); installed, names as common
as `console` or `benchmarks` would shadow (or be shadowed by) a user's own."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = {"sampling", "ngram_assisted", "utils"}


def _source_copy(folder: Path) -> Path:
    """The files a build could pick up (pyproject, README, every top-level package and module), copied
    so that building writes its build/ and egg-info there, not into the checkout."""
    source = folder / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for path in ROOT.iterdir():
        if path.is_dir() and (path / "__init__.py").exists():
            shutil.copytree(path, source / path.name, ignore=shutil.ignore_patterns("__pycache__"))
        elif path.suffix == ".py":
            shutil.copy(path, source / path.name)
    return source


@pytest.mark.subprocess
def test_the_built_distribution_carries_only_the_library(tmp_path):
    pytest.importorskip("setuptools")  # the dev extra installs it; --no-build-isolation builds with it, offline
    source = _source_copy(tmp_path)
    assert {"benchmarks", "console", "infer.py"} <= {path.name for path in source.iterdir()}  # there to be left out
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--disable-pip-version-check",
         "-q", "-w", str(tmp_path / "wheel"), str(source)],
        capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names if ".dist-info/" not in name}
    assert top_level == LIBRARY
    packages = {str(path.parent.relative_to(ROOT)) for name in LIBRARY for path in (ROOT / name).rglob("__init__.py")}
    assert packages == {name.rsplit("/", 1)[0] for name in names if name.endswith("/__init__.py")}  # subpackages too

