"""utils/settings.py: every `SPECDEC_*` variable parses to its documented value or default, a bad value raises a
ValueError naming the variable and the value, `current()` follows an environment changed while the process runs
(as monkeypatch does), and no other library file spells a `SPECDEC_` name (so the one place stays the one place)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch

from utils import freed_memory, paths, settings
from utils.lean import build, huge_pages, kernels, native
from utils.settings import Settings, current, parse

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("utils", "sampling", "ngram_assisted")
SWITCHES = {  # variable -> (field, its value when unset)
    settings.NATIVE_ENV: ("native", True),
    settings.LEAN_ENV: ("lean", True),
    settings.PROGRESS_ENV: ("progress", True),
    settings.HUGE_PAGES_ENV: ("huge_pages", True),
    settings.KEEP_MEMORY_ENV: ("keep_memory", True),
    settings.INVARIANT_ENV: ("width_invariant", None),
    settings.CALIBRATE_ENV: ("calibrate", None),
}


def test_an_empty_environment_gives_the_defaults():
    assert parse({}) == Settings()
    assert parse({name: "" for name in settings.NAMES}) == Settings()  # empty is unset
    assert Settings().native_march == "native" and Settings().cache is None


def test_every_variable_is_in_the_docstring_table_and_a_field():
    assert len(set(settings.NAMES)) == len(settings.NAMES) == 9
    for name in settings.NAMES:
        assert f"    {name} " in settings.__doc__, name
    assert set(SWITCHES) | {settings.CACHE_ENV, settings.MARCH_ENV} == set(settings.NAMES)


@pytest.mark.parametrize("name", sorted(SWITCHES))
def test_a_switch_takes_0_and_1(name):
    field, default = SWITCHES[name]
    assert getattr(parse({}), field) is default
    assert getattr(parse({name: "0"}), field) is False
    assert getattr(parse({name: "1"}), field) is True
    assert getattr(parse({name: " 1\n"}), field) is True  # a stray space from a shell script


@pytest.mark.parametrize("name", sorted(SWITCHES))
@pytest.mark.parametrize("value", ["yes", "true", "2", "off", "-1"])
def test_a_switch_refuses_anything_else(name, value):
    with pytest.raises(ValueError, match=rf"{name}={value!r}.*expected .*0.*1"):
        parse({name: value})


def test_the_cache_folder_is_taken_as_written():
    assert parse({settings.CACHE_ENV: "/tmp/some where"}).cache == Path("/tmp/some where")
    assert parse({settings.CACHE_ENV: "relative/cache"}).cache == Path("relative/cache")


@pytest.mark.parametrize("value", ["haswell", "x86-64-v3", "neoverse-v1", "armv8.2-a+fp16", "znver4"])
def test_the_march_takes_a_cpu_name(value):
    assert parse({settings.MARCH_ENV: value}).native_march == value


@pytest.mark.parametrize("value", ["-O0", "haswell -fplugin=x.so", "native;rm", "a/b"])
def test_the_march_refuses_a_flag_or_anything_not_a_cpu_name(value):
    with pytest.raises(ValueError, match=rf"{settings.MARCH_ENV}={value!r}.*expected a CPU name"):
        parse({settings.MARCH_ENV: value})


def test_current_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(settings.NATIVE_ENV, "0")
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path))
    assert current().native is False and current().cache == tmp_path
    assert current() is current()  # parsed once for this environment
    monkeypatch.setenv(settings.NATIVE_ENV, "1")
    assert current().native is True
    monkeypatch.delenv(settings.NATIVE_ENV)
    monkeypatch.delenv(settings.CACHE_ENV)
    assert current().native is True and current().cache is None
    monkeypatch.setenv(settings.CALIBRATE_ENV, "maybe")
    with pytest.raises(ValueError, match="SPECDEC_CALIBRATE='maybe'"):
        current()
    with pytest.raises(ValueError):  # raised at every read, not once and then forgotten
        current()
    monkeypatch.delenv(settings.CALIBRATE_ENV)
    assert current().calibrate is None


def test_current_reads_what_os_environ_holds_with_or_without_its_dictionary(monkeypatch, tmp_path):
    """The fast path (os.environ's own dictionary, bytes on POSIX) and the public lookups agree, a non-ASCII
    folder included."""
    chosen = tmp_path / "caché"
    monkeypatch.setenv(settings.CACHE_ENV, str(chosen))
    monkeypatch.setenv(settings.PROGRESS_ENV, "0")
    fast = current()
    monkeypatch.setattr(settings, "_ENVIRON", None)
    assert fast == current() == parse(dict(os.environ))
    assert fast.cache == chosen and fast.progress is False


def test_the_readers_follow_the_settings(monkeypatch, tmp_path):
    """The modules that read a variable read it through `current()`: a monkeypatched value reaches them."""
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "chosen"))
    assert paths.configured_cache_dir() == tmp_path / "chosen"
    monkeypatch.setenv(settings.NATIVE_ENV, "0")
    assert native.unavailable() == f"{native.NATIVE_ENV}=0"
    monkeypatch.setenv(settings.INVARIANT_ENV, "1")
    assert kernels.invariance_pays([], []) is True
    monkeypatch.setenv(settings.INVARIANT_ENV, "0")
    assert kernels.invariance_pays([], []) is False
    monkeypatch.setenv(settings.HUGE_PAGES_ENV, "0")
    assert not huge_pages._helps(1 << 30, torch.device("cpu"))
    monkeypatch.setenv(settings.MARCH_ENV, "haswell")
    cpu = [flag for flag in build.flags() if flag.startswith(("-march=", "-mcpu="))]
    assert all(flag.endswith("=haswell") for flag in cpu)  # none on a machine without such a flag
    monkeypatch.setenv(settings.NATIVE_ENV, "yes")
    with pytest.raises(ValueError, match="SPECDEC_NATIVE='yes'"):
        native.unavailable()


def test_the_old_constant_names_are_the_settings_names():
    from utils import calibration, loading, offline_models, quantized_models
    from utils.lean import LEAN_ENV

    assert paths.CACHE_ENV == loading.CACHE_ENV == settings.CACHE_ENV
    assert build.NATIVE_ENV == native.NATIVE_ENV == settings.NATIVE_ENV and build.MARCH_ENV == settings.MARCH_ENV
    assert kernels.INVARIANT_ENV == settings.INVARIANT_ENV and LEAN_ENV == settings.LEAN_ENV
    assert huge_pages.HUGE_PAGES_ENV == settings.HUGE_PAGES_ENV and calibration.CALIBRATE_ENV == settings.CALIBRATE_ENV
    assert freed_memory.KEEP_MEMORY_ENV == settings.KEEP_MEMORY_ENV
    assert calibration.PROGRESS_ENV == offline_models.PROGRESS_ENV == quantized_models.PROGRESS_ENV == settings.PROGRESS_ENV


def _spelled(path: Path) -> list[str]:
    """The string literals of `path` (f-strings' parts included, docstrings and comments left out) that spell a
    `SPECDEC_` name: code that would read or name a variable past utils/settings.py."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    return [f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "SPECDEC_" in node.value
            and id(node) not in docstrings]


def test_only_settings_spells_a_specdec_name():
    found = [line for package in LIBRARY for path in sorted((ROOT / package).rglob("*.py"))
             if path != ROOT / "utils" / "settings.py" for line in _spelled(path)]
    assert not found, "read SPECDEC_* through utils.settings.current():\n" + "\n".join(found)


def test_settings_imports_nothing_from_the_library():
    tree = ast.parse((ROOT / "utils" / "settings.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not {name for name in imported if name.split(".")[0] in (*LIBRARY, "console", "benchmarks")}
