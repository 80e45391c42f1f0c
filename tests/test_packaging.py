"""What `pip install` puts on a user's path: the library's three packages and nothing else. The console
(infer.py, console/) and the benchmarks run from the repository's root (tests/test_console.py starts
infer.py there, tests/test_benchmark.py `python -m benchmarks.spec_bench`); installed, names as common
as `console` or `benchmarks` would shadow (or be shadowed by) a user's own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import require_native

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



GENERATE = """
import json, os, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import utils
from sampling import autoregressive_generate
from utils.lean import forward_path, native

assert utils.__file__.startswith(sys.argv[1]), utils.__file__  # the installed copy, not the checkout
torch.manual_seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.3)
model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
model.generation_config.eos_token_id = None
tokens = autoregressive_generate([1, 5, 9, 3, 17], model, max_gen_len=8)
path = forward_path(model)
with torch.no_grad():  # transformers' own greedy decoding in float32 over the same (bfloat16) values
    reference = model.float().generate(torch.tensor([[1, 5, 9, 3, 17]]), max_new_tokens=8, do_sample=False)
print(json.dumps({"path": path, "tokens": tokens, "reference": reference[0, 5:].tolist(), "off": native.unavailable()}))
"""


@pytest.mark.portable
@pytest.mark.subprocess
def test_an_installed_wheel_builds_its_kernels_and_generates_on_the_native_stack(tmp_path):
    """The wheel carries every C file our kernels build from (decoder.c was once left out: FileNotFoundError at the
    first generation): installed away from the checkout, a tiny bfloat16 Llama generates with its layers in one
    native call, the tokens of transformers' own greedy decoding over the same values in float32."""
    pytest.importorskip("setuptools")
    from utils.lean import build

    require_native()
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--disable-pip-version-check",
         "-q", "-w", str(tmp_path / "wheel"), str(_source_copy(tmp_path))],
        capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    shipped = {name.removeprefix("utils/lean/") for name in zipfile.ZipFile(wheel).namelist()
               if name.endswith((".c", ".h"))}
    assert shipped == {str(path.relative_to(ROOT / "utils" / "lean")) for path in build.key_files()}
    target = tmp_path / "installed"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "-q",
                                "--target", str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    site_packages = next(Path(path) for path in sys.path if path.endswith("site-packages"))
    results = {}
    for native_env in ("1", "0"):
        cache = tmp_path / f"cache-{native_env}"  # a fresh cache: the installed sources are built
        # torch held to AVX2: no bfloat16 arithmetic, so the bfloat16 model computes in float32 over its bfloat16
        # weights, every linear in our kernels: the whole stack in one call whatever this CPU's kernel tables say.
        environment = {**os.environ, "PYTHONPATH": f"{target}{os.pathsep}{site_packages}", "SPECDEC_CACHE": str(cache),
                       "SPECDEC_NATIVE": native_env, "ATEN_CPU_CAPABILITY": "avx2"}
        ran = subprocess.run([sys.executable, "-c", GENERATE, str(target)], cwd=elsewhere, env=environment,
                             capture_output=True, text=True, timeout=300)
        assert ran.returncode == 0, ran.stderr[-3000:]
        results[native_env] = json.loads(ran.stdout.strip().splitlines()[-1])
    assert results["1"]["off"] is None and results["1"]["path"] == "lean forward (llama.py, its layers in one native call)"
    assert results["0"]["path"] == "lean forward (llama.py, layers in Python: SPECDEC_NATIVE=0)"
    assert results["1"]["tokens"] == results["1"]["reference"] and len(results["1"]["tokens"]) == 8
