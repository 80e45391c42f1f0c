"""Where the library keeps what it builds once (de-quantized models, measured pass costs, kernel tables, our built
kernels), and how it writes there safely.

    cache_dir()             the cache folder: $SPECDEC_CACHE, else $XDG_CACHE_HOME/speculative-decoding, else
                            ~/.cache/speculative-decoding; a private folder of this process's own where that one is
                            refused (`cache_refused` says why)
    write_cached(path, fn)  keep a file under the cache: written whole or not at all, never seen half-written
    untrusted(path)         why a cached file or folder must not be read (someone else's, or writable by others)
    private_folder(path)    create a folder (0700) and say why it cannot be used, None when it can
    private_temp()          a folder of this process's own (0700, removed at exit)
    unique_partial(path)    a fresh file beside `path` to fill before `settle` moves it into place
    settle(partial, path)   flush `partial` to the disk and move it to `path` in one step

Why refuse a folder another user can write to: our kernels are loaded as machine code (`utils/lean/build.py`) and
a planted file there would run as this user; a refused cache is replaced by a private folder for this process (a
warning says so once: everything is built again at every start until the folder is fixed).
"""

from __future__ import annotations

import atexit
import os
import shutil
import stat
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

from utils import settings

__all__ = ["CACHE_ENV", "CacheWarning", "cache_dir", "cache_refused", "configured_cache_dir", "private_folder",
           "private_temp", "settle", "unique_partial", "untrusted", "write_cached"]

CACHE_ENV = settings.CACHE_ENV
_LOCK = threading.Lock()
_TEMP: list[Path] = []  # this process's private folder, once made
_WARNED: set[str] = set()


class CacheWarning(UserWarning):
    """The cache cannot be used as it is (refused or unwritable): things are built again, or not kept."""


def configured_cache_dir() -> Path:
    """$SPECDEC_CACHE, else $XDG_CACHE_HOME/speculative-decoding, else ~/.cache/speculative-decoding."""
    chosen = settings.current().cache
    if chosen is not None:
        return chosen
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "speculative-decoding"


def cache_dir() -> Path:
    """The cache folder (`configured_cache_dir`), created 0700 where missing; where it is refused (`untrusted`) or
    cannot be created, a private folder of this process's own instead (`private_temp`, warned once). Checked at
    every call (a few system calls): a folder opened to others later is refused from then on."""
    configured = configured_cache_dir()
    reason = private_folder(configured)
    if reason is not None and settings.current().cache is None and _tightened(configured):
        reason = private_folder(configured)
    if reason is None:
        return configured
    folder = private_temp()
    _warn_once(f"the cache folder {configured} is refused ({reason}): this process keeps what it builds in "
               f"{folder}, built again at every start (fix: chmod 700 it, or set {CACHE_ENV})")
    return folder


def _tightened(folder: Path) -> bool:
    """Whether the default cache folder, this user's own but writable by its group (made under a umask of 002, as
    Debian and Ubuntu give users), was set to 0700: a folder someone chose in $SPECDEC_CACHE is left as it is."""
    try:
        status = os.lstat(folder)
        if stat.S_ISLNK(status.st_mode) or not stat.S_ISDIR(status.st_mode) or status.st_uid != os.getuid():
            return False
        os.chmod(folder, 0o700)
    except (OSError, AttributeError):
        return False
    return True


def cache_refused() -> str | None:
    """Why the configured cache folder is not the one in use (`cache_dir`), None when it is."""
    return private_folder(configured_cache_dir())


def untrusted(path: Path) -> str | None:
    """Why `path` (a cached file or folder) must not be trusted: missing, a link, not this user's, or writable by
    group or others; None when it can be."""
    try:
        status = os.lstat(path)
    except OSError as error:
        return f"{path} cannot be read: {error.strerror or error}"
    if stat.S_ISLNK(status.st_mode):
        return f"{path} is a symbolic link"
    if hasattr(os, "getuid") and status.st_uid != os.getuid():
        return f"{path} belongs to user {status.st_uid}, not to this one ({os.getuid()})"
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by {'others' if status.st_mode & stat.S_IWOTH else 'its group'}"
    return None


def private_folder(path: Path) -> str | None:
    """Create `path` (and the folders above it) where missing, itself 0700; why it cannot hold cached files
    (`untrusted`, not a folder, not writable), None when it can."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
    except OSError as error:
        return f"it cannot be created: {error}"
    if not path.is_dir():
        return "not a folder"
    reason = untrusted(path.resolve())  # a link to a folder: the folder it names
    if reason is None and not os.access(path, os.W_OK | os.X_OK):
        reason = "not writable"
    return reason


def private_temp() -> Path:
    """A folder of this process's own (0700 under the system's temporary folder), removed when it exits."""
    with _LOCK:
        if not _TEMP:
            _TEMP.append(Path(tempfile.mkdtemp(prefix="specdec-private-")))
            atexit.register(shutil.rmtree, _TEMP[0], ignore_errors=True)
        return _TEMP[0]


def unique_partial(path: Path) -> Path:
    """A new empty file (0600) beside `path`, named for no one else (threads, processes, containers sharing the
    folder): the one to fill, then `settle`."""
    descriptor, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    os.close(descriptor)
    return Path(name)


def settle(partial: Path, path: Path) -> None:
    """Flush `partial` to the disk, then move it to `path` in one step (a reader sees the old file or the whole new
    one, after a crash too), and flush the folder's entry."""
    with open(partial, "rb+") as file:
        os.fsync(file.fileno())
    os.replace(partial, path)
    try:
        folder = os.open(path.parent, os.O_RDONLY)
    except OSError:  # a platform that cannot open a folder: the file itself is on the disk
        return
    try:
        os.fsync(folder)
    except OSError:
        pass
    finally:
        os.close(folder)


def write_cached(path: Path, write: Callable[[Path], object]) -> bool:
    """Keep a file under the cache: `write(partial)` fills a file of its own (`unique_partial`), then it is moved to
    `path` in one step (`settle`), so that a reader (another process measuring the same) never sees half a file.
    Whether it was kept: not where its folder is refused (`private_folder`) or the disk says no (warned once; what
    it holds is measured or built again next time)."""
    reason = private_folder(path.parent)
    if reason is not None:
        _warn_once(f"{path.name} is not kept in {path.parent} ({reason}): it is made again next time")
        return False
    try:
        partial = unique_partial(path)
    except OSError as error:
        _warn_once(f"{path.name} is not kept in {path.parent} ({error.strerror or error}): it is made again next time")
        return False
    try:
        write(partial)
        settle(partial, path)
    except OSError as error:
        _warn_once(f"{path.name} is not kept in {path.parent} ({error.strerror or error}): it is made again next time")
        return False
    finally:
        partial.unlink(missing_ok=True)
    return True


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, CacheWarning, stacklevel=3)
