"""Calibration: what a pass over 1 + k new tokens costs here, measured once and cached.

1. `calibrate(model)` times passes over 1 + k new tokens (k = 0 and `DRAFT_SIZES`) after a context of
   `CONTEXT` tokens, interleaved over repeats (a slow moment spreads over every k), each with every
   combination of the CPU shortcuts of `utils/cpu_passes.py`, and keeps for each k the fastest
   combination: the kernel choice is a measurement too. Medians; a calibration whose repeats
   disagree is taken again, and if it still disagrees, dropped for the prior.
2. `pass_costs(model)` calibrates once per model and caches the result on disk
   (`cache_dir()/costs/`) under a key that changes with the architecture, dtype, device, thread
   count, CPU, torch and transformers versions, attention implementation and the kernels' source.
   The one wait a user sees: a progress bar on stderr says so (`SPECDEC_PROGRESS=0` hides it).
3. A busy machine's table is never stored. Other work on the cores does not slow every pass alike
   (a wide pass can look as cheap as a one-token pass: docs/results.md, "Figures behind the code's
   rules"), so such a table is wrong, not just slow. `CoreWatch` asks the kernel how
   long this process's threads were runnable but waiting for a core (Linux's per-thread
   `schedstat`): waiting more than `BUSY_WAIT` of the time they were ready to run means the cores
   were not ours. Why that signal: it is direct (CPU time against wall time cannot tell a
   Python-bound pass on one thread from a starved one; the load average lags a minute and counts
   our own threads), cheap to read after every pass, and, as a share of the time our threads were
   ready to run, independent of the model, its size and the thread count. Where the kernel
   does not say (macOS, Windows), a load average above the core count before starting stands in.
   On a busy machine the calibration stops as soon as the signal is clear (`BUSY_AFTER` seconds
   in), the run uses the prior, one line on stderr says so, and nothing is cached: the next start
   does not measure for `BACK_OFF` seconds (a `.busy` note beside the table's file, with the time;
   `SPECDEC_CALIBRATE=1` measures anyway), and the line names what to set (`utils/threads.py`).
   A process that met a busy machine (or dropped a noisy table) does not try again: the first call
   never waits minutes.
4. A stored table is checked against the passes generation times anyway (`PassCosts.observe`):
   when they disagree by more than the table's own spread (and `cost_model.STALE_MIN`), its file
   is deleted, and the next start measures again.

The layering: `utils/cost_model.py` (the costs, no model) <- `utils/runners/` (the runners use
and refine them) <- this module (runs the runner to measure them).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import time
import weakref
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import PreTrainedModel

from utils import cpu_passes, settings, threads
from utils.cost_model import DRAFT_SIZES, PassCosts, prior_costs
from utils.cpu_passes import Shortcuts
from utils.lean import lean_decoder
from utils.machine import calibration_key
from utils.paths import cache_dir
from utils.runners import SequenceRunner
from utils.runners.model_info import context_length, is_encoder_decoder, vocab_size
from utils.runners.passes import synchronize
from utils.runners.static import StaticSequence

__all__ = ["CoreWatch", "MachineBusy", "calibrate", "is_measured", "pass_costs", "time_passes"]

CONTEXT = 256  # tokens already in the cache when a calibration pass runs
REPEATS = 3
MAX_SPREAD = 0.25  # (max - min) / median of the one-token pass's repeats above this: a busy machine
CALIBRATE_ENV = settings.CALIBRATE_ENV  # "0": use PRIOR, measure nothing up front; "1": measure even when backed off
BACK_OFF = 3600.0  # seconds after a busy machine stopped a calibration in which later starts do not try again
PROGRESS_ENV = settings.PROGRESS_ENV  # "0": no progress bar while calibrating
# Share of the time our threads were ready to run that they spent waiting for a core, above which
# the cores were not ours. A 2-core CPU with light background work measured 0.05-0.13; one thread
# against two busy loops, 0.67; 16 threads against one other job on 16 cores would wait ~1/17.
BUSY_WAIT = 0.25
BUSY_AFTER = 1.0  # seconds measured before the busy signal may stop a calibration (a blip averages out)
_CHECK_EVERY = 0.1  # seconds between two reads of the kernel's counters during a calibration


class MachineBusy(RuntimeError):
    """The cores were not ours while measuring: the timings are not this machine's."""


def _scheduler_times() -> tuple[float, float] | None:
    """(seconds on a core, seconds runnable but waiting for one) of this process's live threads
    (Linux: the first two fields of /proc/self/task/*/schedstat), None where the kernel does not say."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    running = waiting = 0
    read = False
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/schedstat") as stats:
                fields = stats.read().split()
            running, waiting, read = running + int(fields[0]), waiting + int(fields[1]), True
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return (running / 1e9, waiting / 1e9) if read else None


def _loaded() -> bool:
    """More runnable threads than cores over the last minute (the fallback signal; ours are at most
    one thread before a calibration starts)."""
    try:
        return os.getloadavg()[0] > (os.cpu_count() or 1)
    except (AttributeError, OSError):
        return False  # no load average (Windows): assume quiet


class CoreWatch:
    """Whether this process had the cores to itself since the watch was made (see the module's
    docstring, point 3, for the rule and why)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self._times = _scheduler_times()
        self.loaded = self._times is None and _loaded()  # known before measuring anything

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def waiting(self) -> float:
        """The share of the time since the start that our threads were ready to run and waited for
        a core (0.0 where unknown)."""
        times = _scheduler_times()
        if self._times is None or times is None:
            return 0.0
        running, waiting = (now - then for now, then in zip(times, self._times, strict=True))
        return waiting / (running + waiting) if waiting > 0 else 0.0

    def busy(self) -> bool:
        return self.loaded or self.waiting() > BUSY_WAIT

    def reason(self) -> str:
        if self.loaded:
            return f"load average above {os.cpu_count()} cores"
        return f"its threads waited for a core {self.waiting():.0%} of the time"


def time_passes(
    model: PreTrainedModel, choices: list[Shortcuts], repeats: int, watch: CoreWatch | None = None,
    pruned: bool = True,
) -> dict[tuple[int, Shortcuts], list[float]]:
    """Seconds of each (k, shortcuts) pass, `repeats` times each, interleaved; `pruned`: a choice
    far behind at some k in the warm-up round is not repeated there (`prune`), and the repeats of
    passes over more than one token stop at `BUDGET_SECONDS` (one at least; a 1.5B model in float32
    on 2 cores: one repeat, ~60 s in all). With a `watch`,
    raises `MachineBusy` as soon as it says busy (after `BUSY_AFTER` seconds)."""
    limit = context_length(model)
    context = CONTEXT if limit is None else max(1, min(CONTEXT, limit - max(DRAFT_SIZES) - 2))
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, min(vocab_size(model), 10_000), (context + max(DRAFT_SIZES) + 1,), generator=generator)
    tokens = tokens.tolist()
    runner = _runner(model, tokens[:context])
    device = runner.device
    times: dict[tuple[int, Shortcuts], list[float]] = {}
    plan = [(k, choice) for k in (0, *DRAFT_SIZES) for choice in choices]
    # The one wait a user sees (seconds, once per machine and model): say so on stderr, as
    # transformers does while it loads weights.
    progress = tqdm(total=(repeats + 1) * len(plan), desc="Measuring pass costs here (once)",
                    unit="pass", leave=False, file=sys.stderr, disable=not settings.current().progress)
    next_check = BUSY_AFTER
    full_rounds, warm_start = repeats, time.perf_counter()
    try:
        for round_ in range(repeats + 1):  # the first round warms every shape up and is not kept
            if round_ == 1 and pruned:  # a kernel choice far behind at some k is not timed again there
                plan = prune(plan, times)
                # A large model's passes are dear: as many full rounds as fit the budget (one at least),
                # the cheap one-token passes (the spread check's) in every round.
                warm, full = time.perf_counter() - warm_start, sum(times[pair][0] for pair in plan)
                full_rounds = max(1, min(repeats, int((BUDGET_SECONDS - warm) / full)))
                progress.total = progress.n + full_rounds * len(plan) + (repeats - full_rounds) * len(choices)
            if round_ > full_rounds:
                plan = [(k, choice) for k, choice in plan if k == 0]
            for k, choice in plan:
                progress.update()
                synchronize(device)
                start = time.perf_counter()
                runner.forward(tokens[context : context + k + 1], num_logits=k + 1, shortcuts=choice)
                synchronize(device)
                times.setdefault((k, choice), []).append(time.perf_counter() - start)
                runner.rollback(context)  # a static buffer: a length moves; a growing cache: cropped
                # Give up at once on a busy machine: every later pass would be as wrong and slower.
                if watch is not None and watch.elapsed() >= next_check:
                    next_check = watch.elapsed() + _CHECK_EVERY
                    if watch.busy():
                        raise MachineBusy(watch.reason())
    finally:
        progress.close()
    return {key: values[1:] for key, values in times.items() if len(values) > 1}


def _runner(model: PreTrainedModel, context: list[int]):
    """The runner generation gives `model`, its cache holding `context`; its `forward(tokens,
    num_logits=, shortcuts=)` and `rollback(length)`."""
    if lean_decoder(model) is not None:  # our own forward, over the static buffer generation gives it
        runner = StaticSequence(model, slots=len(context) + max(DRAFT_SIZES) + 1)
    else:
        runner = SequenceRunner(model, encoder_input_ids=context if is_encoder_decoder(model) else None)
    runner.forward(context)
    return runner


BUDGET_SECONDS = 40.0  # of a first calibration, past the warm-up round: repeats beyond it are dropped
PRUNE_FACTOR = 1.5  # a choice whose warm-up pass took this many times the fastest's at that k is dropped


def prune(plan: list[tuple[int, Shortcuts]], warm: dict[tuple[int, Shortcuts], list[float]]) -> list[tuple[int, Shortcuts]]:
    """The (k, choice) pairs worth repeating: within `PRUNE_FACTOR` of the fastest warm-up pass at
    that k. Halves a large model's calibration (4 choices a k on a CPU) without changing its verdict:
    a choice that far behind in one pass does not win the median of three."""
    fastest: dict[int, float] = {}
    for (k, _), seconds in warm.items():
        fastest[k] = min(fastest.get(k, float("inf")), seconds[0])
    return [(k, choice) for k, choice in plan if warm[(k, choice)][0] <= PRUNE_FACTOR * fastest[k]]


def calibrate(model: PreTrainedModel, repeats: int = REPEATS, watch: CoreWatch | None = None) -> tuple[PassCosts, float]:
    """Measure `model`'s pass costs here -> (costs, spread of the one-token pass's repeats).
    With a `watch`, raises `MachineBusy` as soon as it says the cores were not ours."""
    # Our own forward (`utils/lean/`) chose its kernels per shape: no shortcut is patched into it.
    choices = [Shortcuts()] if lean_decoder(model) is not None else cpu_passes.available_shortcuts(model)
    times = time_passes(model, choices, repeats, watch)
    relative, shortcuts = {}, {}
    for k in (0, *DRAFT_SIZES):
        timed = [choice for choice in choices if (k, choice) in times]  # those `prune` kept
        shortcuts[k] = min(timed, key=lambda choice: statistics.median(times[(k, choice)]))
        relative[k] = statistics.median(times[(k, shortcuts[k])])
    one_token = times[(0, shortcuts[0])]
    base = relative[0]
    spread = (max(one_token) - min(one_token)) / base
    # The table's own spread, what online timings are allowed to differ by: the widest of any k.
    table_spread = max((max(times[(k, shortcuts[k])]) - min(times[(k, shortcuts[k])])) / relative[k] for k in relative)
    relative = {k: seconds / base for k, seconds in relative.items()}
    # A longer pass never costs less than a shorter one in this model: smooth out timing noise.
    for k0, k1 in zip(sorted(relative), sorted(relative)[1:], strict=False):
        relative[k1] = max(relative[k1], relative[k0])
    return PassCosts(relative, base, shortcuts, measured=True, spread=table_spread), spread


_COSTS: weakref.WeakKeyDictionary[PreTrainedModel, PassCosts] = weakref.WeakKeyDictionary()
# What this process decided not to measure again: a busy machine stops every calibration until the
# next start; a table too noisy to keep stops that key's.
_busy_seen = False
_DROPPED: set[Path] = set()
_told = False  # the one stderr line per process


def pass_costs(model: PreTrainedModel) -> PassCosts:
    """The pass costs of `model` here: from memory, from the disk cache, or calibrated now (a few
    seconds for a 135M model, once per machine and setting). One object per model, so that what
    generation observes online is shared by every later call."""
    costs = _COSTS.get(model)
    if costs is not None:
        return costs
    if settings.current().calibrate is False:
        costs = prior_costs()
    else:
        costs = _cached_or_calibrated(model)
    _COSTS[model] = costs
    return costs


def _cache_path(model: PreTrainedModel) -> tuple[dict, Path]:
    key = calibration_key(model)
    return key, cache_dir() / "costs" / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20] + ".json")


def _load(path: Path) -> PassCosts | None:
    try:
        return PassCosts.from_json(json.loads(path.read_text())["costs"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or unreadable: measured again


def is_measured(model: PreTrainedModel) -> bool:
    """Whether `pass_costs(model)` answers without measuring anything (known in memory, cached on
    disk, calibration switched off, or given up in this process): a console can say what it is
    about to wait for."""
    if model in _COSTS or settings.current().calibrate is False or _busy_seen:
        return True
    path = _cache_path(model)[1]
    return path in _DROPPED or _load(path) is not None or _busy_before(path) is not None


def _tell(message: str, again: str = "measured again at the next start") -> None:
    """Say once per process, in one line on stderr, that this run uses the prior costs (the issue
    is the machine's, and a user who hid progress bars still wants to know why drafting is off)."""
    global _told
    if not _told:
        _told = True
        # stderr, as the progress bars: stdout is the caller's (a notebook's cell, the console's answer)
        sys.stderr.write(f"specdec: {message}; using the prior pass costs for this run, nothing cached "
                         f"({again}; {CALIBRATE_ENV}=0 skips measuring)\n")


def _busy_note(path: Path) -> Path:
    return path.with_suffix(".busy")


def _busy_before(path: Path) -> float | None:
    """Seconds since a busy machine stopped this table's calibration, if under `BACK_OFF` (and not forced)."""
    if settings.current().calibrate:
        return None
    try:
        ago = time.time() - float(json.loads(_busy_note(path).read_text())["busy_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return ago if 0 <= ago < BACK_OFF else None


def _back_off(path: Path, reason: str) -> None:
    """Remember the busy attempt, with its time: later starts use the prior until `BACK_OFF` has passed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _busy_note(path).write_text(json.dumps({"busy_at": time.time(), "reason": reason}))


def _busy_line(reason: str) -> str:
    advice = threads.advice(torch.get_num_threads(), threads.measure())
    return f"the machine was busy while measuring pass costs ({reason}{'; ' + advice if advice else ''})"


def _store(key: dict, path: Path, costs: PassCosts, spread: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}")
    partial.write_text(json.dumps({"key": key, "spread": spread, "costs": costs.to_json()}, indent=1))
    partial.replace(path)


def _checked_online(costs: PassCosts, path: Path) -> PassCosts:
    """A stored table whose file is deleted when the passes of generation disagree with it."""
    costs.on_stale = lambda: path.unlink(missing_ok=True)
    return costs


def _cached_or_calibrated(model: PreTrainedModel) -> PassCosts:
    global _busy_seen
    key, path = _cache_path(model)
    costs = _load(path)
    if costs is not None:
        return _checked_online(costs, path)
    if _busy_seen or path in _DROPPED:
        return prior_costs()  # given up in this process already: no second wait
    ago = _busy_before(path)
    if ago is not None:  # a busy machine stopped the last try: not every start pays for one
        _tell(f"the machine was busy when these pass costs were measured {ago / 60:.0f} min ago",
              f"tried again {BACK_OFF / 3600:.0f} h after that, or with {CALIBRATE_ENV}=1")
        return prior_costs()
    for _ in range(2):  # repeats that disagree on a quiet machine (a burst): measure once more
        watch = CoreWatch()
        try:
            if watch.loaded:
                raise MachineBusy(watch.reason())
            costs, spread = calibrate(model, REPEATS, watch)
            if watch.busy():  # a calibration shorter than BUSY_AFTER is judged as a whole
                raise MachineBusy(watch.reason())
        except MachineBusy as busy:
            _busy_seen = True
            _back_off(path, str(busy))
            _tell(_busy_line(str(busy)), f"not measured for {BACK_OFF / 3600:.0f} h, or with {CALIBRATE_ENV}=1")
            return prior_costs()
        if spread <= MAX_SPREAD:
            _busy_note(path).unlink(missing_ok=True)
            _store(key, path, costs, spread)
            return _checked_online(costs, path)
    # Too noisy to trust, and not cached: online observations take over.
    _DROPPED.add(path)
    _tell(f"pass costs of {type(model).__name__} varied by {spread:.0%} between repeats")
    return prior_costs()
