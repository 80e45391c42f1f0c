"""How many threads torch should run on here, from what the other processes are doing now.

Why: beside another CPU-bound job, torch's one-thread-per-core default makes every parallel region
wait for the slowest thread, the one sharing a core, and OpenMP's idle threads spin on the cores the
other job needs. On a 2-core AMD EPYC Zen 3 beside one busy process the console decoded 0.6-4 tokens/s
on 2 threads and 11.7 tokens/s on 1 (docs/cost_model.md, "A busy machine").

What is measured: the CPU time the cores this process may run on (`os.sched_getaffinity`) spent busy
over a short window (`/proc/stat`, Linux), less this process's own (`/proc/self/stat`): the other
processes' load, in cores. The load average stands in elsewhere (it lags a minute and counts our own
threads). And the CPU time its control group may take (`cpu_quota`: a container's `--cpus`, a Kubernetes
limit), which the affinity does not show: torch starts a thread per core it sees, and threads past the quota
are stopped until the next period, each parallel region waiting for them (on a 2-vCPU AMD EPYC Zen 4, the 1.5B's
one-token pass under a quota of 1 core: 201 ms on 2 threads, 125 on 1; of 1.5 cores: 130-136 against 118-123;
docs/cost_model.md). The rule reads the quota where it runs; it holds no figure.
Imports nothing heavy: `infer.py` asks before torch starts, so that OpenMP starts right.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

__all__ = ["FairShare", "Fit", "advice", "available_cores", "cpu_quota", "fair_share", "fit_threads", "measure",
           "other_load", "settle_openmp", "thread_limit"]

SAMPLE_SECONDS = 0.2  # the window `other_load` watches: long enough for a few scheduler ticks
BUSY_CORE = 0.5  # cores' worth of other work from which a core counts as taken
WATCH_SECONDS = 0.5  # `FairShare`'s window: 100 ticks of 2 cores at Linux's 100 a second, read between passes
STALE_WINDOWS = 4  # a longer window in which this process mostly idled (a pause between generations) decides nothing


def available_cores() -> int:
    """The cores this process may run on (its affinity), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def _cgroup_limit(folder: str) -> float | None:
    """The CPU limit one control group's folder states, in cores: cgroup v2's `cpu.max` ("max 100000" for none) or
    v1's `cpu.cfs_quota_us` (-1 for none) over `cpu.cfs_period_us`; None where it states none."""
    try:
        with open(os.path.join(folder, "cpu.max")) as limit:
            quota, period = limit.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(folder, "cpu.cfs_quota_us")) as q, open(os.path.join(folder, "cpu.cfs_period_us")) as p:
            quota, period = int(q.read()), int(p.read())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def cpu_quota(root: str = "/sys/fs/cgroup", membership: str = "/proc/self/cgroup") -> float | None:
    """The CPU time this process's control group may take, in cores: the tightest limit from its own group up to the
    hierarchy's root (cgroup v2, or v1's cpu controller mounted under `root`); None where no group sets one, or the
    kernel does not say (not Linux). Inside a container the group's path may name the host's hierarchy: the folders
    that do not exist are passed over, the container's own group being the mount's root."""
    try:
        with open(membership) as lines:
            groups = [line.rstrip("\n").split(":", 2) for line in lines]
    except OSError:
        return None
    mounts = []
    for _, controllers, path in (group for group in groups if len(group) == 3):
        if controllers == "":  # cgroup v2: the unified hierarchy at root (or root/unified beside a v1 one)
            mounts += [(root, path), (os.path.join(root, "unified"), path)]
        elif "cpu" in controllers.split(","):
            try:
                names = [name for name in os.listdir(root) if "cpu" in name.split(",")]
            except OSError:
                names = []
            mounts += [(os.path.join(root, name), path) for name in names]
    limits = []
    for mount, path in mounts:
        parts = [part for part in path.split("/") if part]
        for depth in range(len(parts), -1, -1):
            limit = _cgroup_limit(os.path.join(mount, *parts[:depth]))
            if limit is not None:
                limits.append(limit)
    return min(limits) if limits else None


def thread_limit() -> int:
    """The threads that can run at once here: the cores of the affinity, and no more than the whole cores of a CPU
    quota (`cpu_quota`; one at least): a thread past the quota's whole cores runs only part of each period, and the
    parallel regions wait for it (1.5 cores on 2: 1 thread, module docstring)."""
    cores, quota = available_cores(), cpu_quota()
    return cores if quota is None else max(1, min(cores, int(quota)))


def _cpu_ticks(cpus: set[int]) -> tuple[int, int] | None:
    """(busy ticks, all ticks) of `cpus` since boot (Linux /proc/stat), None where unknown."""
    try:
        with open("/proc/stat") as stat:
            lines = stat.read().splitlines()
    except OSError:
        return None
    busy = total = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        ticks = [int(field) for field in fields[:8]]  # user nice system idle iowait irq softirq steal
        busy, total = busy + sum(ticks) - ticks[3] - ticks[4], total + sum(ticks)
    return (busy, total) if total else None


def _own_ticks() -> int | None:
    """This process's user + system ticks (/proc/self/stat, fields 14 and 15)."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


def other_load(seconds: float = SAMPLE_SECONDS) -> float | None:
    """Cores' worth of CPU time that other processes used on our cores over the next `seconds`
    (sleeps that long), None where the kernel does not say; the load average elsewhere."""
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:
        cpus = None
    before, own_before = (_cpu_ticks(cpus), _own_ticks()) if cpus else (None, None)
    if before is None or own_before is None:
        try:
            return max(0.0, os.getloadavg()[0] - 1.0)  # ours is one runnable thread at most, here
        except (AttributeError, OSError):
            return None
    time.sleep(seconds)
    after, own_after = _cpu_ticks(cpus), _own_ticks()
    if after is None or own_after is None or after[1] == before[1]:
        return None
    share = (after[0] - before[0] - (own_after - own_before)) / (after[1] - before[1])
    return max(0.0, share * len(cpus))


@dataclass(frozen=True)
class Fit:
    """What was measured and the thread count that fits it."""

    cores: int  # the cores this process may run on
    busy: float  # cores' worth of other processes' work on them
    threads: int  # the threads that fit: one per core the others leave free, within the quota, one at least
    limit: int | None = None  # the threads a CPU quota allows (`thread_limit`), where fewer than the cores

    @property
    def crowded(self) -> bool:
        return self.busy >= BUSY_CORE

    @property
    def capped(self) -> bool:
        """Other processes hold cores, or a CPU quota allows fewer threads than the cores."""
        return self.crowded or self.limit is not None

    def why(self) -> str:
        """What keeps threads off the cores, in a few words."""
        said = []
        if self.limit is not None:
            said.append(f"a CPU quota allows {self.limit} of {self.cores} cores")
        if self.crowded:
            said.append(f"other processes keep {self.busy:.1f} of {self.cores} cores busy")
        return " and ".join(said)


def measure(seconds: float = SAMPLE_SECONDS) -> Fit | None:
    """The machine now (sleeps `seconds`), None where unknown."""
    busy = other_load(seconds)
    if busy is None:
        return None
    cores, limit = available_cores(), thread_limit()
    return Fit(cores, busy, max(1, min(limit, round(cores - busy))), limit if limit < cores else None)


def settle_openmp(environ: dict | None = None) -> str | None:
    """Before torch is imported (a program's start, e.g. `infer.py`): on a crowded machine, set
    `OMP_NUM_THREADS` to the free cores and `OMP_WAIT_POLICY=PASSIVE` (idle threads sleep instead of
    spinning on the others' cores), each unless the user set it; under a CPU quota, `OMP_NUM_THREADS` to its
    whole cores. Returns the one line to show, or None."""
    environ = os.environ if environ is None else environ
    if "OMP_NUM_THREADS" in environ and "OMP_WAIT_POLICY" in environ:
        return None  # the user chose both
    fit = measure()
    if fit is None or not fit.capped:
        return None
    chosen = []
    if "OMP_NUM_THREADS" not in environ:
        environ["OMP_NUM_THREADS"] = str(fit.threads)
        chosen.append(f"{fit.threads} thread{'s' * (fit.threads > 1)}")
    if "OMP_WAIT_POLICY" not in environ and fit.crowded:  # under a quota alone, threads spin on cores of their own
        environ["OMP_WAIT_POLICY"] = "PASSIVE"
        chosen.append("idle threads sleep")
    if not chosen:
        return None
    why = fit.why()
    return f"{why[0].upper()}{why[1:]}: {', '.join(chosen)} (set OMP_NUM_THREADS and OMP_WAIT_POLICY to choose)"


def fit_threads(fit: Fit | None = None) -> str | None:
    """After torch started: fewer torch threads where other processes hold cores (never more than
    torch has). Returns the one line saying so, or None when nothing changed."""
    import torch  # here: this module is imported before torch by `infer.py`

    fit = measure() if fit is None else fit
    now = torch.get_num_threads()
    if fit is None or not fit.capped or fit.threads >= now:
        return None
    torch.set_num_threads(fit.threads)
    why = fit.why()
    return (f"{why[0].upper()}{why[1:]}: torch on {fit.threads} thread{'s' * (fit.threads > 1)} instead of {now} "
            "(torch.set_num_threads chooses)")


def advice(threads: int, fit: Fit | None) -> str | None:
    """What a library user should set, in a few words, when torch's `threads` do not fit `fit`."""
    if fit is None or not fit.capped or fit.threads >= threads:
        return None
    passive = " and OMP_WAIT_POLICY=PASSIVE (set before torch starts)" if fit.crowded else ""
    return f"{fit.why()}: torch.set_num_threads({fit.threads}){passive} run faster"


class FairShare:
    """torch's thread count (our kernels take the same, `utils.lean.native`) kept to the cores other processes leave
    free, watched as passes run: called before each pass, it reads `/proc/stat` at most once every `WATCH_SECONDS`
    (a few microseconds a pass otherwise) and compares with its last reading, so it never sleeps (a reading from
    before a pause between generations, `STALE_WINDOWS`, is not compared with: the next one is). Beside a busy
    process each parallel region otherwise waits for the thread that shares its core: plain decoding of the built-in
    135M on 2 cores took 4.06x its quiet time a token without it, 1.96x with it (an AMD EPYC, docs/results.md,
    nineteenth round; a 1.5B on a Xeon, 3.67x without). Never above the count it found set (the user's,
    `torch.set_num_threads`) nor above a CPU quota's whole cores (`thread_limit`, read at each window, from the first
    call on); a count set by someone else since its last change becomes that count."""

    def __init__(self, seconds: float = WATCH_SECONDS) -> None:
        self.seconds = seconds
        self._wanted: int | None = None  # the thread count to give back when the cores are free again
        self._set: int | None = None  # the count this watcher last set
        self._checked: float | None = None  # when the machine was last read
        self._last: tuple[float, int, int, int] | None = None  # (time, busy ticks, all ticks, our ticks)

    def __call__(self) -> None:
        import torch  # here: this module is imported before torch by `infer.py`

        now = time.monotonic()
        if self._checked is not None and now - self._checked < self.seconds:
            return
        self._checked = now
        current = torch.get_num_threads()
        if current != self._set:  # the user's (first sight, or changed since)
            self._wanted = current
        limit = min(self._wanted, thread_limit())
        if current > limit:  # a quota: at once, not a window later (the first pass is the prompt's, the longest)
            torch.set_num_threads(limit)
            current = self._set = limit
        reading = self._reading(now)
        if reading is None:
            return
        last, self._last = self._last, reading
        if last is None or reading[2] == last[2]:
            return
        cores = available_cores()
        cores_per_tick = cores / (reading[2] - last[2])
        ours = (reading[3] - last[3]) * cores_per_tick
        if now - last[0] > STALE_WINDOWS * self.seconds and ours < BUSY_CORE:
            return  # a pause between generations: what ran then says little of now; the next window decides
        busy = max(0.0, (reading[1] - last[1]) * cores_per_tick - ours)
        threads = max(1, min(limit, round(cores - busy) if busy >= BUSY_CORE else cores))
        if threads != current:
            torch.set_num_threads(threads)
        self._set = threads

    @staticmethod
    def _reading(now: float) -> tuple[float, int, int, int] | None:
        try:
            cpus = os.sched_getaffinity(0)
        except AttributeError:
            return None
        ticks, own = _cpu_ticks(cpus), _own_ticks()
        return None if ticks is None or own is None else (now, *ticks, own)


fair_share = FairShare()  # the process's watcher (`utils.runners.passes.ModelPasses.run` calls it before each pass)
