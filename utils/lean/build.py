"""Our kernels' build: the C sources beside this file compiled for this CPU by its C compiler at first use (5-20 s),
kept under `cache_dir()/kernels` and loaded from there at later starts, every load checked first.

    load()              the loaded library and None, or None and why it cannot be had
    announced(loader)   wraps the library's loader (`native._library`): one warning a process where our kernels
                        cannot run, naming why and what it costs (none under `SPECDEC_NATIVE=0`: a choice)
    compiler()          the compiler's command ($CC split as a shell splits it, else cc or gcc) and None, or None
                        and why not
    flags(openmp, version)  the compile flags for this machine: -march=native (x86-64) or -mcpu=native (Arm),
                        `SPECDEC_NATIVE_MARCH` naming another target (`haswell`: an AVX2-only CPU's code); gcc's
                        own (`GCC_FLAGS`) where the compiler's --version output names GCC
    sources()           the files compiled (every .c file beside this one); key_files() every C file the build
                        depends on (headers and subfolders too: part of the build's key)

How the cache stays sound: one build at a time under a lock (`<name>.lock`, flock), compiled into a file of its own
(`paths.unique_partial`), flushed to the disk and renamed into place (`paths.settle`) with its SHA-256 recorded
beside it (`<name>.sha256`). Before every load the file is checked (this user's, writable by no one else, its
recorded SHA-256): dlopen of a truncated library dies of SIGBUS, and a file planted there would run as this user.
A file failing the check is built again once, then the reason is given up. Where the cache folder is refused or
cannot be written, the kernels are built into a folder of this process's own (`paths.private_temp`), warned once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from utils import paths, settings

try:
    import fcntl
except ImportError:  # not a POSIX system: one process at a time is assumed
    fcntl = None

__all__ = ["COST", "MARCH_ENV", "NATIVE_ENV", "NativeKernelsOff", "announced", "compiler", "flags", "key_files",
           "load", "sources"]

NATIVE_ENV = settings.NATIVE_ENV  # "0": none of our kernels, torch's operations everywhere (a choice: not warned)
MARCH_ENV = settings.MARCH_ENV  # the target CPU of -march (x86-64) or -mcpu (Arm) instead of "native"
HERE = Path(__file__).parent
# -ffp-contract=off: a product and a sum written apart stay apart (rounded as torch's eager steps round them)
BASE_FLAGS = ("-O3", "-ffp-contract=off", "-shared", "-fPIC")
# gcc tuned for some CPUs (Zen's -march=native; newer gcc's for some Intel cores too) leaves a product and a sum apart
# where the sum is a loop's running accumulator, while fused.h's fp-contract=fast fuses the same expression elsewhere:
# a query's bits then depend on which of two loops computed it (on a Zen 3, tests/native/test_kernels.c's fuzz and
# tests/test_layer_ops.py failed; thirty-third round, docs/results.md). gcc takes this only from the command line.
GCC_FLAGS = ("--param=avoid-fma-max-bits=0",)
OPENMP = "-fopenmp"  # tried first; the sources build without it (one thread), where a compiler has no OpenMP
LIBRARIES = ("-lm",)
COST = ("the lean forward runs on torch's operations, about 10% slower a pass and, on CPUs without bfloat16 "
        "arithmetic, twice the weight bytes")
_LOCK = threading.Lock()  # one build at a time in this process (the file lock orders processes)
_ANNOUNCED: list[str] = []  # the reason warned about, once a process


class NativeKernelsOff(UserWarning):
    """Our native kernels cannot run here: the lean forward takes torch's operations."""


def sources() -> tuple[Path, ...]:
    """The C files compiled together into the library: every .c file beside this one."""
    return tuple(sorted(HERE.glob("*.c")))


def key_files() -> tuple[Path, ...]:
    """Every C source and header under this folder (subfolders too): what the built library depends on."""
    return tuple(sorted(path for path in HERE.rglob("*") if path.suffix in (".c", ".h") and path.is_file()))


def compiler() -> tuple[list[str] | None, str | None]:
    """The C compiler's command: $CC as a shell splits it ("ccache gcc", "gcc -m64"), else cc or gcc on the PATH;
    or None and why there is none."""
    configured = os.environ.get("CC", "").strip()
    if not configured:
        found = shutil.which("cc") or shutil.which("gcc")
        return ([found], None) if found else (None, "no C compiler (cc, gcc or $CC) to build them")
    try:
        words = shlex.split(configured)
    except ValueError as error:
        return None, f"CC={configured!r} is not a command: {error}"
    if shutil.which(words[0]) is None:
        return None, f"no C compiler: CC={configured!r} names {words[0]}, not found"
    return words, None


def flags(openmp: bool = True, version: str = "") -> tuple[str, ...]:
    """The compile flags here: `BASE_FLAGS`, this CPU's instructions (`SPECDEC_NATIVE_MARCH` or native), OpenMP, and
    `GCC_FLAGS` where `version` (the compiler's --version output) names GCC."""
    machine, target = platform.machine().lower(), settings.current().native_march
    if machine in ("x86_64", "amd64", "i386", "i686"):
        cpu = (f"-march={target}",)
    elif machine in ("aarch64", "arm64") or machine.startswith(("ppc", "powerpc")):
        cpu = (f"-mcpu={target}",)  # gcc's spelling for these (clang takes it too)
    else:
        cpu = ()
    gcc = "Free Software Foundation" in version and "clang" not in version
    return (BASE_FLAGS[0], *cpu, *((OPENMP,) if openmp else ()), *BASE_FLAGS[1:], *(GCC_FLAGS if gcc else ()))


def announced(loader: Callable[[], tuple[object, str | None]]) -> Callable[[], tuple[object, str | None]]:
    """`loader` (the library and None, or None and why not), warning once a process where our kernels cannot run,
    unless `SPECDEC_NATIVE=0` chose so."""

    @functools.wraps(loader)
    def load_announced():
        library, reason = loader()
        if reason is not None and settings.current().native and not _ANNOUNCED:
            _ANNOUNCED.append(reason)
            warnings.warn(f"our native kernels are off here ({reason}): {COST} ({NATIVE_ENV}=0 chooses that without "
                          f"this warning)", NativeKernelsOff, stacklevel=3)
        return library, reason

    return load_announced


def load() -> tuple[ctypes.CDLL | None, str | None]:
    """Our kernels' library: from the cache, after its check, or built now (module docstring); None and why not."""
    command, reason = compiler()
    if command is None:
        return None, reason
    try:
        version = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"{shlex.join(command)} did not run: {error}"
    if version.returncode != 0:
        return None, f"{shlex.join(command)} --version failed: {version.stderr.strip()[-300:]}"
    name = f"specdec-{_key(command, version.stdout)}.so"
    folder = paths.cache_dir() / "kernels"
    refused = paths.private_folder(folder)
    if refused is None:
        try:
            return _load_or_build(command, version.stdout, folder / name)
        except OSError as error:  # a full disk, a folder turned read-only
            refused = f"it cannot be written: {error.strerror or error}"
    private = paths.private_temp() / "kernels"
    if folder == private or paths.private_folder(private) is not None:
        return None, f"no folder to build them in ({folder}: {refused})"
    _cache_warning(f"our kernels' cache folder {folder} is refused ({refused}): they are built for this process "
                   f"alone in {private}, again at every start")
    try:
        return _load_or_build(command, version.stdout, private / name)
    except OSError as error:
        return None, f"they cannot be built in {private}: {error.strerror or error}"


def _key(command: list[str], version: str) -> str:
    """What the built library depends on: the sources, the compiler and its version, the flags and this CPU."""
    digest = hashlib.sha256()
    for part in (*(f"{path.relative_to(HERE)}\0".encode() + path.read_bytes() for path in key_files()),
                 shlex.join(command).encode(), version.encode(), _cpu_flags().encode(), platform.machine().encode(),
                 shlex.join([*flags(version=version), *LIBRARIES]).encode()):
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()[:20]


def _cpu_flags() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


def _record(path: Path) -> Path:
    """Where the SHA-256 of the library at `path` is kept."""
    return path.with_name(path.name + ".sha256")


def _load_or_build(command: list[str], version: str, path: Path) -> tuple[ctypes.CDLL | None, str | None]:
    """The library at `path` once it passes its check, built there first (by `command`, whose --version output is
    `version`) where missing or failing it; OSError where the folder cannot be written."""
    with _LOCK, _locked(path.with_name(path.name + ".lock")):
        problem = _problem(path)
        if problem is None:
            return _opened(path)
        if problem != "missing":
            _cache_warning(f"our cached kernels {path} were refused ({problem}): built again")
        failed = _build(command, version, path)
        if failed is not None:
            return None, failed
        problem = _problem(path)
        if problem is not None:
            return None, f"the kernels just built fail their check ({problem})"
        return _opened(path)


def _problem(path: Path) -> str | None:
    """Why the library at `path` must not be loaded ("missing" where never built), None when it can: its file and
    its record this user's and writable by no one else, the file not empty, its SHA-256 the one recorded."""
    record = _record(path)
    if not os.path.lexists(path) and not os.path.lexists(record):
        return "missing"
    for file in (path, record):
        reason = paths.untrusted(file)
        if reason is not None:
            return reason
    if path.stat().st_size == 0:
        return f"{path.name} is empty"
    try:
        expected = record.read_text().strip()
    except (OSError, ValueError) as error:
        return f"its record cannot be read: {error}"
    if _sha256(path) != expected:
        return f"{path.name}'s SHA-256 is not the one recorded when it was built (truncated, changed or replaced)"
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _build(command: list[str], version: str, path: Path) -> str | None:
    """Compile the sources into `path` (with OpenMP, else without), its SHA-256 recorded; why not where the compiler
    fails. OSError where the folder cannot be written."""
    partial = paths.unique_partial(path)
    try:
        errors = []
        for openmp in (True, False):
            try:
                built = subprocess.run([*command, *flags(openmp, version), *map(str, sources()), "-o", str(partial), *LIBRARIES],
                                       capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.SubprocessError) as error:
                built = subprocess.CompletedProcess([], returncode=1, stderr=str(error))
            if built.returncode == 0 and partial.exists() and partial.stat().st_size > 0:
                break
            errors.append(built.stderr.strip()[-300:])
        else:
            return f"{shlex.join(command)} could not build {', '.join(p.name for p in sources())}: {errors[-1]}"
        os.chmod(partial, 0o700)  # the linker's own mode follows the umask (group-writable under 002)
        digest = _sha256(partial)
        record = paths.unique_partial(_record(path))
        try:
            record.write_text(digest + "\n")
            paths.settle(partial, path)
            paths.settle(record, _record(path))
        finally:
            record.unlink(missing_ok=True)
        return None
    finally:
        partial.unlink(missing_ok=True)


def _opened(path: Path) -> tuple[ctypes.CDLL | None, str | None]:
    try:
        return ctypes.CDLL(str(path)), None
    except OSError as error:  # e.g. a cache on a file system mounted noexec
        return None, f"the built kernels do not load: {error}"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold the lock file `path` (created 0600 where missing, never removed: removing it would let two builders in)."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        if fcntl is not None:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # the lock goes with it


def _cache_warning(message: str) -> None:
    warnings.warn(message, paths.CacheWarning, stacklevel=4)
