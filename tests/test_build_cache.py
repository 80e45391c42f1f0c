"""Our kernels' build and cache (`utils/lean/build.py`) and every cached file (`utils/paths.py`), fault by fault:
builders at once (threads, processes, the same pid), a damaged or planted library (refused before dlopen, built
again), a folder or file another user can write (refused: a private folder instead), an unwritable cache, no
compiler (one warning, the reason in `forward_path`, the tokens unchanged) and a compiler given with arguments.

One real build serves the file (`prebuilt`); most tests build with `fake_cc`, a stand-in compiler that copies it
where the real one would write, so that they check the cache's logic in milliseconds."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.conftest import missing_native, require_native
from utils import paths
from utils.lean import LEAN_ENV, build, forget, forward_path, kernels, native

ROOT = Path(__file__).resolve().parent.parent
FAKE_CC = """#!/bin/sh
# A stand-in C compiler: its version, else a copy of $FAKE_CC_OUTPUT where -o says (no -fopenmp under FAKE_CC_NO_OPENMP).
if [ "$1" = "--version" ]; then echo "fake-cc 1.0"; exit 0; fi
echo "$*" >> "$FAKE_CC_LOG"
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    -o) out="$2"; shift ;;
    -fopenmp) if [ -n "$FAKE_CC_NO_OPENMP" ]; then echo "unrecognized option -fopenmp" >&2; exit 1; fi ;;
  esac
  shift
done
cp "$FAKE_CC_OUTPUT" "$out"
"""


@pytest.fixture(autouse=True)
def _fresh_process_state(monkeypatch):
    """Each test starts as a new process would: no library loaded yet, no warning given, no private folder made; after
    it, the next test file loads the suite's own library again."""
    def clear():
        native._library.cache_clear()
        kernels.kernel_table.cache_clear()
        build._ANNOUNCED.clear()
        paths._WARNED.clear()

    clear()
    monkeypatch.setattr(paths, "_TEMP", [])
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)
    monkeypatch.delenv(build.MARCH_ENV, raising=False)
    yield
    clear()


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory) -> Path:
    """Our kernels built once for this file by the real compiler (a fresh cache)."""
    cache = tmp_path_factory.mktemp("prebuilt")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(paths.CACHE_ENV, str(cache))
        patch.delenv("CC", raising=False)
        library, reason = build.load()
    assert library is not None, reason
    (built,) = (cache / "kernels").glob("*.so")
    return built


@pytest.fixture
def fake_cc(tmp_path, monkeypatch, prebuilt) -> SimpleNamespace:
    """$CC a stand-in that copies `prebuilt`, $SPECDEC_CACHE a fresh folder; `builds()` counts its compiles."""
    script = tmp_path / "bin" / "fake-cc"
    script.parent.mkdir()
    script.write_text(FAKE_CC)
    script.chmod(0o755)
    log = tmp_path / "cc.log"
    cache = tmp_path / "cache"
    for name, value in {"CC": str(script), "FAKE_CC_OUTPUT": str(prebuilt), "FAKE_CC_LOG": str(log),
                        paths.CACHE_ENV: str(cache)}.items():
        monkeypatch.setenv(name, value)
    return SimpleNamespace(cache=cache, builds=lambda: len(log.read_text().splitlines()) if log.exists() else 0)


def _cached(folder: Path) -> Path:
    (library,) = folder.glob("specdec-*.so")
    return library


def _works(library) -> bool:
    return library is not None and library.specdec_block() in (8, 16, 32)


def _record(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _replace(path: Path, data: bytes) -> None:
    """`path` now holds `data`: a new file (the one this process loaded stays mapped whole, as a crashed writer's
    would not be in another process)."""
    partial = path.with_name("damaged")
    partial.write_bytes(data)
    partial.chmod(0o700)
    os.replace(partial, path)


def _loaded_warning(expected: type[Warning]) -> tuple:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        library, reason = build.load()
    return library, reason, [str(w.message) for w in caught if issubclass(w.category, expected)]


# ---- builders at once ----


@pytest.mark.slow
def test_two_threads_building_at_first_use_both_get_one_working_library(tmp_path, monkeypatch):
    """A fresh cache, the real compiler, two threads of one process (the same pid: temp names are not per pid)."""
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    start, results = threading.Barrier(2), []

    def first_use():
        start.wait()
        results.append(build.load())

    threads = [threading.Thread(target=first_use) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [reason for _, reason in results] == [None, None] and all(_works(library) for library, _ in results)
    folder = tmp_path / "kernels"
    assert build._problem(_cached(folder)) is None
    assert sorted(path.suffix for path in folder.iterdir()) == [".lock", ".sha256", ".so"]  # no partial file left


@pytest.mark.slow
@pytest.mark.subprocess
def test_two_processes_building_at_once_share_one_library(fake_cc, tmp_path):
    """Two processes with the same pid's temp name (containers sharing a volume): the lock and unique temp files."""
    code = ("import os; os.getpid = lambda: 4242\n"
            "from utils.lean import build\nlibrary, reason = build.load()\nassert library is not None, reason\n")
    started = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.PIPE, text=True)
               for _ in range(2)]
    for process in started:
        assert process.wait(timeout=300) == 0, process.stderr.read()
    assert fake_cc.builds() == 1  # the second waited for the first's build, then loaded it
    assert build._problem(_cached(fake_cc.cache / "kernels")) is None


def test_cached_files_written_at_once_under_one_pid_never_collide(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    path, start, kept = tmp_path / "costs" / "table.json", threading.Barrier(8), []

    def write(number: int):
        start.wait()
        kept.append(paths.write_cached(path, lambda file: file.write_text(str(number) * 10_000)))

    threads = [threading.Thread(target=write, args=(number,)) for number in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert kept == [True] * 8 and path.read_text() in {str(number) * 10_000 for number in range(8)}
    assert [p.name for p in path.parent.iterdir()] == ["table.json"]  # no partial file left
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700


# ---- a damaged or planted library: refused before it is loaded, built again ----


@pytest.mark.parametrize("damage", ["truncated", "zeroed", "empty", "planted", "no_record", "open_to_others"])
def test_a_damaged_or_planted_library_is_refused_before_loading_and_built_again(fake_cc, damage, prebuilt):
    library, reason = build.load()
    assert _works(library) and reason is None and fake_cc.builds() == 1
    cached = _cached(fake_cc.cache / "kernels")
    good = cached.read_bytes()
    if damage == "truncated":  # dlopen would die of SIGBUS: the check must come first
        _replace(cached, good[: len(good) // 2])
    elif damage == "zeroed":
        _replace(cached, bytes(len(good)))
    elif damage == "empty":
        _replace(cached, b"")
    elif damage == "planted":  # another library under the expected name
        _replace(cached, (Path(torch.__file__).parent / "lib" / "libc10.so").read_bytes())
    elif damage == "no_record":
        _record(cached).unlink()
    else:
        cached.chmod(0o777)
    assert build._problem(cached) is not None
    native._library.cache_clear()
    library, reason, refused = _loaded_warning(paths.CacheWarning)
    assert _works(library) and reason is None, reason
    assert fake_cc.builds() == 2 and len(refused) == 1 and "refused" in refused[0] and "built again" in refused[0]
    assert cached.read_bytes() == good and build._problem(cached) is None


def test_a_library_owned_by_another_user_is_refused(fake_cc):
    if os.getuid() != 0:
        pytest.skip("giving a file to another user takes root")
    build.load()
    cached = _cached(fake_cc.cache / "kernels")
    os.chown(cached, 12345, 12345)
    assert "belongs to user 12345" in build._problem(cached)
    library, reason, refused = _loaded_warning(paths.CacheWarning)
    assert _works(library) and fake_cc.builds() == 2 and "belongs to user 12345" in refused[0]


def test_a_build_that_fails_its_check_again_is_given_up_with_the_reason(fake_cc, tmp_path, monkeypatch):
    empty = tmp_path / "empty.so"
    empty.write_bytes(b"")
    monkeypatch.setenv("FAKE_CC_OUTPUT", str(empty))  # the compiler writes nothing, with and without OpenMP
    library, reason = build.load()
    assert library is None and "could not build" in reason and fake_cc.builds() == 2
    assert not list((fake_cc.cache / "kernels").glob("*.so"))


# ---- folders: refused where others can write, a private one where the cache cannot be used ----


@pytest.mark.parametrize("fault", ["open_to_others", "another_owner", "under_a_file", "kernels_open_to_others"])
def test_a_refused_or_unwritable_cache_builds_in_a_private_folder(fake_cc, fault, monkeypatch):
    cache = fake_cc.cache
    if fault == "under_a_file":  # unwritable (root writes through chmod 500: a path under a file cannot be made)
        cache.parent.joinpath("file").write_text("")
        monkeypatch.setenv(paths.CACHE_ENV, str(cache.parent / "file" / "cache"))
    else:
        cache.mkdir(mode=0o700)
        if fault == "open_to_others":
            cache.chmod(0o777)
        elif fault == "kernels_open_to_others":
            (cache / "kernels").mkdir(mode=0o700)
            (cache / "kernels").chmod(0o777)
        elif os.getuid() == 0:
            os.chown(cache, 12345, 12345)
        else:
            pytest.skip("giving a folder to another user takes root")
    library, reason, refused = _loaded_warning(paths.CacheWarning)
    assert _works(library) and reason is None, reason
    private = paths.private_temp()
    assert stat.S_IMODE(private.stat().st_mode) == 0o700 and build._problem(_cached(private / "kernels")) is None
    expected = {"open_to_others": "writable by others", "another_owner": "belongs to user 12345",
                "under_a_file": "cannot be created", "kernels_open_to_others": "writable by others"}[fault]
    assert len(refused) == 1 and expected in refused[0] and str(private) in refused[0]
    if fault != "kernels_open_to_others":
        assert paths.cache_dir() == private and expected in paths.cache_refused()
        assert paths.write_cached(paths.cache_dir() / "costs" / "x.json", lambda file: file.write_text("{}"))
        assert (private / "costs" / "x.json").exists()


def test_the_default_cache_made_under_a_group_umask_is_made_private_not_refused(tmp_path, monkeypatch):
    """~/.cache/speculative-decoding made 0775 (a umask of 002, Debian's and Ubuntu's for users) is this user's own:
    set to 0700 and used; the same mode on a folder named in $SPECDEC_CACHE is left alone and refused."""
    monkeypatch.delenv(paths.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    default = tmp_path / "speculative-decoding"
    default.mkdir()
    default.chmod(0o775)
    assert paths.cache_dir() == default and stat.S_IMODE(default.stat().st_mode) == 0o700
    chosen = tmp_path / "chosen"
    chosen.mkdir()
    chosen.chmod(0o775)
    monkeypatch.setenv(paths.CACHE_ENV, str(chosen))
    with pytest.warns(paths.CacheWarning, match="writable by its group"):
        assert paths.cache_dir() != chosen
    assert stat.S_IMODE(chosen.stat().st_mode) == 0o775


def test_a_cache_that_cannot_be_written_at_build_time_builds_in_a_private_folder(fake_cc, monkeypatch):
    """A folder that passes its check yet refuses the write (a read-only mount as root, a full disk)."""
    real = build._build
    failures = []

    def read_only(command, version, path):
        if not failures:
            failures.append(path)
            raise OSError(errno.EROFS, "Read-only file system")
        return real(command, version, path)

    monkeypatch.setattr(build, "_build", read_only)
    library, reason, refused = _loaded_warning(paths.CacheWarning)
    assert _works(library) and reason is None
    assert failures[0].parent == fake_cc.cache / "kernels" and "Read-only file system" in refused[0]
    assert build._problem(_cached(paths.private_temp() / "kernels")) is None


def test_a_cached_file_is_not_kept_where_its_folder_cannot_be_written(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.warns(paths.CacheWarning, match="not kept"):
        assert not paths.write_cached(tmp_path / "file" / "costs" / "x.json", lambda file: file.write_text("{}"))
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)
    with pytest.warns(paths.CacheWarning, match="writable by others"):
        assert not paths.write_cached(open_folder / "x.json", lambda file: file.write_text("{}"))
    assert list(open_folder.iterdir()) == []


# ---- the compiler: none, failing, given with arguments; the flags ----


def _tiny_llama(dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.3)
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    return model


def _tokens(model) -> list[int]:
    from sampling import autoregressive_generate

    forget(model)  # its lean forward built again under this environment
    return autoregressive_generate([1, 5, 9, 3, 17], model, max_gen_len=8)


@pytest.mark.parametrize("compiler", ["/nonexistent/cc", "false"])
def test_without_a_working_compiler_one_warning_says_why_and_the_tokens_stay_right(compiler, monkeypatch, tmp_path):
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CC", compiler)
    model = _tiny_llama(torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert native.unavailable() and native.unavailable()
        tokens = _tokens(model)
        path = forward_path(model)
    off = [str(w.message) for w in caught if issubclass(w.category, build.NativeKernelsOff)]
    reason = native.unavailable()
    assert len(off) == 1 and reason in off[0] and "10% slower" in off[0]
    assert {"/nonexistent/cc": "no C compiler", "false": "--version failed"}[compiler] in reason
    assert path == f"lean forward (llama.py, layers in Python: {reason})"
    monkeypatch.setenv(LEAN_ENV, "0")  # the Hugging Face model's own forward
    assert _tokens(model) == tokens
    forget(model)


def test_native_off_by_choice_gives_no_warning_and_says_so(monkeypatch):
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    model = _tiny_llama(torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = forward_path(model)
    assert not [w for w in caught if issubclass(w.category, build.NativeKernelsOff)]
    assert path == "lean forward (llama.py, layers in Python: SPECDEC_NATIVE=0)"
    forget(model)


def test_a_model_whose_layers_run_in_python_says_why(monkeypatch):
    require_native()
    model = _tiny_llama(torch.float32)  # float32 weights: torch's products, so no native stack
    forget(model)
    assert forward_path(model) == ("lean forward (llama.py, layers in Python: a linear our kernels do not run (int8, "
                                   "torch's int4, hooked or another dtype))")
    forget(model)


@pytest.mark.slow
@pytest.mark.parametrize("compiler", ["env gcc -O2"])
def test_a_compiler_given_with_arguments_builds(compiler, monkeypatch, tmp_path):
    """$CC as a shell would split it (as "ccache gcc" is given)."""
    if shutil.which("gcc") is None:
        missing_native("no gcc here to build our kernels with")
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CC", compiler)
    assert build.compiler()[0] == ["env", "gcc", "-O2"]
    library, reason = build.load()
    assert _works(library) and reason is None, reason


def test_a_compiler_without_openmp_builds_without_it(fake_cc, monkeypatch):
    monkeypatch.setenv("FAKE_CC_NO_OPENMP", "1")
    library, reason = build.load()
    assert _works(library) and reason is None and fake_cc.builds() == 2  # with OpenMP, then without


def test_the_flags_name_this_machines_cpu(monkeypatch):
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    assert "-march=native" in build.flags() and build.OPENMP in build.flags()
    assert build.OPENMP not in build.flags(openmp=False)
    assert {"-O3", "-ffp-contract=off", "-shared", "-fPIC"} <= set(build.flags(openmp=False))
    # gcc's tuning that leaves a loop's running sum unfused (a Zen's), turned off for gcc alone
    gcc, clang = "gcc (Debian 12.2.0-14) 12.2.0\nCopyright (C) 2022 Free Software Foundation, Inc.", "Debian clang version 14"
    assert set(build.GCC_FLAGS) <= set(build.flags(version=gcc)) and not set(build.GCC_FLAGS) & set(build.flags(version=clang))
    monkeypatch.setenv(build.MARCH_ENV, "haswell")  # an AVX2-only CPU's code (benchmarks/passes.py --emulate-avx2)
    assert "-march=haswell" in build.flags() and "-march=native" not in build.flags()
    monkeypatch.delenv(build.MARCH_ENV)
    monkeypatch.setattr(build.platform, "machine", lambda: "aarch64")
    assert "-mcpu=native" in build.flags() and not any(flag.startswith("-march") for flag in build.flags())


def test_every_c_file_under_the_kernels_folder_is_in_the_build_and_the_wheel():
    folder = ROOT / "utils" / "lean"
    assert set(build.sources()) == set(folder.glob("*.c")) and set(build.sources()) <= set(build.key_files())
    assert {path for path in folder.rglob("*") if path.suffix in (".c", ".h")} == set(build.key_files())
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"utils.lean" = ["*.c", "*.h", "**/*.c", "**/*.h"]' in pyproject
