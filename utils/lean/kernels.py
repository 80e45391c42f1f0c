"""The GEMM kernel each pass width takes on this machine: measured once per weight shape, dtype and machine (a
second or two, over more bytes than the caches hold), kept under `SPECDEC_CACHE/kernels`.

Why measure: which product streams a weight matrix fastest for a few rows differs by CPU and dtype, by 2x.
Measured on a Xeon with AMX (2 threads, bfloat16, 40 matrices of 8960 x 1536 in turn, GB/s of weights read):
`F.linear` at one row 11.3, at eight 16.9; the weight-major product `W @ x.T` at one row 18.3, at two 21.8, at four
23.6, at eight 17.5, at sixteen 22.6; `torch.mv` at one row 24.9 (a `sum` reads 30). So a row count may run
fastest padded to another, and the choice is a table, not a rule.

Kernels, for x (rows, in) and W (out, in):
    ("linear", 0)        F.linear(x, W, b)
    ("mv", 0)            torch.mv(W, x[0]): one row
    ("weight_major", p)  (W @ x.T).T with x padded by zero rows to p rows (0: not padded)
    ("native", 0)        our own kernel for bfloat16 weights (`native.py`, `gemm.c`), where it builds here: on a CPU
                         with AMX, bfloat16 activations take the tile unit (32 rows for one row's price)
A float64 weight always takes F.linear: the exact tests compare it with the Hugging Face model's own.

Width invariance: in bfloat16 a pass over k tokens must give each token the very bits a one-token pass gives it,
or greedy speculation parts from plain greedy decoding at near-ties. Kernels come in two families whose members
agree among themselves: torch's (each candidate checked, bit for bit, against the same rows in a 32-row
weight-major product, `REFERENCE`; the fastest that agrees is taken per row count) and our own kernel alone (one
fixed summation order per output, checked the same way against its own 32-row product). The family whose choices
cost less over the row counts (the mean of each count's time over that count's fastest) is the invariant one, and
it is taken where that mean is at most `INVARIANCE_PAYS` (`KernelTable`); every other op of a pass is computed per
row already. Measured on the Xeon (bfloat16): `torch.mv` and every
padded product agree except one-row products over an 8960-wide input, so torch's family costs nothing there; in
float32 no one-row torch kernel agrees with the multi-row ones (a one-row pass is padded to two). With AMX our own
kernel is the faster at every row count there (docs/results.md, eleventh round): its family is the invariant choice.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from utils import settings
from utils.lean import native
from utils.paths import cache_dir, write_cached

__all__ = ["BUCKETS", "INVARIANT_ENV", "Kernel", "KernelTable", "apply", "choice_path", "invariance_pays",
           "kernel_table", "prepare", "q4_in_pieces", "q4_product"]

BUCKETS = (1, 2, 4, 8, 16, 32)  # rows r take the table's entry for the smallest bucket >= r; past 32, F.linear
PROBE_BYTES = 1 << 29  # matrices timed in turn, at most: beyond the caches, so that the weights come from memory
PROBE_CACHES = 4  # and at least this many times the last-level caches' bytes, where the machine tells them
REPEATS = 2
Kernel = tuple[str, int]
LINEAR: Kernel = ("linear", 0)
REFERENCE: Kernel = ("weight_major", 32)  # the product every width-invariant torch kernel agrees with, bit for bit
NATIVE: Kernel = ("native", 0)
_CODE = hashlib.sha256(Path(__file__).read_bytes() + native.GEMM_VERSION.encode()).hexdigest()[:12]  # a table's version
INVARIANT_ENV = settings.INVARIANT_ENV  # "0": the fastest kernel per width; "1": the invariant ones at any price
AGREEMENT_OUTPUTS = 1 << 18  # outputs compared per kernel and row count before it counts as width-invariant
AGREEMENT_ROWS = 1024  # and at most so many rows (a one-row kernel: as many calls), for weights of under 256 outputs
INVARIANCE_PAYS = 1.05  # the invariant family's mean price over the row counts that it may cost by default
Q4_PROBE = (16 * native.MAX_ROWS, 2048)  # a 4-bit prompt pass's probe: its rows, and the weight's (`q4_in_pieces`)


def apply(kernel: Kernel, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """y = x W^T + b, (rows, out), by `kernel`."""
    name, pad = kernel
    if name == "linear":
        return F.linear(x, weight, bias)
    if name == "native":
        return native.gemm(x, weight, bias)
    rows = x.shape[0]
    if name == "mv":
        out = torch.mv(weight, x[0])[None]
    else:
        if pad > rows:
            x = torch.cat([x, x.new_zeros(pad - rows, x.shape[1])])
        out = (weight @ x.T)[:, :rows].T.contiguous()
    return out if bias is None else out + bias


def _candidates(bucket: int, shape: tuple[int, int], dtype: torch.dtype) -> list[Kernel]:
    pads = sorted({p for p in (bucket, 2 * bucket, 16, 32) if bucket <= p <= 32} - {bucket}) if bucket > 1 else [2]
    return [LINEAR, ("weight_major", 0), *(("weight_major", p) for p in pads), *([("mv", 0)] if bucket == 1 else []),
            *([NATIVE] if native.supports(shape, dtype) else [])]


def _measure(shape: tuple[int, int], dtype: torch.dtype, device: str) -> dict[int, dict]:
    """Per bucket: every candidate's best seconds over the probe matrices, the fastest, and the invariant choice
    (the cheaper family's kernel: see the module's docstring)."""
    count = max(1, min(64, _probe_bytes() // (shape[0] * shape[1] * torch.finfo(dtype).bits // 8)))
    # One random matrix for the bits; the others only have to be elsewhere in memory (cheap to fill).
    weights = [torch.randn(shape, device=device).to(dtype)]
    weights += [torch.full(shape, 0.01, dtype=dtype, device=device) for _ in range(count - 1)]
    x_all = torch.randn(BUCKETS[-1], shape[1], device=device).to(dtype)
    probes = _probe_rows(shape, dtype, device)
    references = {REFERENCE: _by_chunks(REFERENCE, probes, weights[0])}
    if native.supports(shape, dtype):
        references[NATIVE] = _by_chunks(NATIVE, probes, weights[0])
    table, timings = {}, {}
    families = {family: [] for family in references}  # each family's choice per bucket, None where none agrees
    for bucket in BUCKETS:
        x = x_all[:bucket]
        seconds = timings[bucket] = {}
        for kernel in _candidates(bucket, shape, dtype):
            best = float("inf")
            for _ in range(REPEATS + 1):
                start = time.perf_counter()
                for weight in weights:
                    apply(kernel, x, weight, None)
                best = min(best, time.perf_counter() - start)
            seconds[kernel] = best
        checked = min(len(probes), -(-AGREEMENT_OUTPUTS // (shape[0] * bucket)) * bucket)
        for family, reference in references.items():  # its fastest member that agrees (checked fastest first)
            members = sorted((k for k in seconds if (k == NATIVE) == (family == NATIVE)), key=seconds.get)
            agrees = (k for k in members if torch.equal(_by_chunks(k, probes[:checked], weights[0], bucket),
                                                        reference[:checked]))
            families[family].append(next(agrees, None))
        table[bucket] = {"fastest": min(seconds, key=seconds.get), "seconds": [[*k, t] for k, t in seconds.items()]}
    price = {family: sum(timings[b][k] / min(timings[b].values()) for b, k in zip(BUCKETS, choices, strict=True))
             for family, choices in families.items() if None not in choices}
    chosen = families[min(price, key=price.get)] if price else [REFERENCE] * len(BUCKETS)
    for bucket, kernel in zip(BUCKETS, chosen, strict=True):
        table[bucket]["invariant"] = kernel
    return table


def _probe_bytes() -> int:
    """The bytes of weights each kernel is timed over: `PROBE_CACHES` times the machine's last-level caches (each
    distinct L3 in sysfs counted once), so that every matrix comes from memory again, and never more than
    `PROBE_BYTES`, which is what is taken where sysfs says nothing. On a 2-vCPU Zen 4 (32 MB of L3) a 135M model's
    tables took 7.5 s over 128 MB against 14.5 s over 512 MB, the same kernels chosen (twenty-sixth round)."""
    caches = {}
    for index in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            if (index / "level").read_text().strip() != "3":
                continue
            size = (index / "size").read_text().strip()  # "32768K"
            shift = {"K": 10, "M": 20, "G": 30}.get(size[-1:], 0)
            caches[(index / "shared_cpu_list").read_text().strip()] = int(size.rstrip("KMG")) << shift
        except (OSError, ValueError):
            continue
    total = sum(caches.values())
    return min(PROBE_BYTES, PROBE_CACHES * total) if total else PROBE_BYTES


def _probe_rows(shape: tuple[int, int], dtype: torch.dtype, device: str) -> Tensor:
    """Random rows for the bits check, enough that `AGREEMENT_OUTPUTS` outputs are compared per row count (a whole
    number of `REFERENCE`'s 32 rows). Two summation orders give other bfloat16 bits only where a sum falls near a
    rounding edge: on an AMD EPYC (Zen 4), one 32-row probe of a 96 x 1536 weight let a one-row `F.linear` that
    parts from the 32-row product on 1 output in 10^4 pass as agreeing (docs/results.md, nineteenth round)."""
    rows = -(-min(AGREEMENT_ROWS, max(BUCKETS[-1], AGREEMENT_OUTPUTS // shape[0])) // BUCKETS[-1]) * BUCKETS[-1]
    return torch.randn(rows, shape[1], device=device).to(dtype)


def _by_chunks(kernel: Kernel, x: Tensor, weight: Tensor, rows: int = BUCKETS[-1]) -> Tensor:
    """`kernel` over `x` in passes of `rows` rows (the last one short where they do not divide it)."""
    return torch.cat([apply(kernel, part, weight, None) for part in x.split(rows)])


class KernelTable:
    """The kernel for each row count of one weight shape and dtype: the width-invariant family's (a row's result
    the same bits whatever the pass's width: greedy speculation then equals plain greedy decoding to the bit in
    every dtype) where it costs at most `INVARIANCE_PAYS` of the fastest kernels on average over the row counts,
    else the fastest per row count (`invariant` False). `SPECDEC_WIDTH_INVARIANT=1` takes the invariant family
    whatever its price, `=0` the fastest. `price`: how much slower the invariant family is, by bucket (1.0: free);
    `seconds`: by bucket, (the invariant family's kernel, the fastest one), what a model weighs its layers by
    (`linear.numerics`: a model's passes are priced whole, and `take` then sets every table alike).

    Why a price limit: where no torch product agrees across widths (MKL's float32 products on an AVX2-only CPU
    differ between 8 rows and the same rows among 32), the invariant choice is the 32-row product itself, and a
    one-row pass would cost 32 rows' arithmetic (seen with torch held to AVX2 on the Xeon)."""

    def __init__(self, measured: dict[int, dict]) -> None:
        self._measured = measured
        self.price, self.seconds = {}, {}
        for bucket, entry in measured.items():
            seconds = {(name, pad): t for name, pad, t in entry.get("seconds", [])}
            if seconds:
                fastest = min(seconds.values())
                self.seconds[bucket] = (seconds.get(tuple(entry["invariant"]), fastest), fastest)
                self.price[bucket] = self.seconds[bucket][0] / fastest
        self.take(invariance_pays([self], [1]))

    def take(self, invariant: bool) -> None:
        """Use the invariant family's kernels (`invariant`) or the fastest per row count."""
        self.invariant = invariant
        kind = "invariant" if invariant else "fastest"
        by_bucket = {bucket: tuple(entry[kind]) for bucket, entry in self._measured.items()}
        self._by_rows = [LINEAR] + [by_bucket[next(b for b in BUCKETS if b >= rows)] for rows in range(1, BUCKETS[-1] + 1)]

    def __call__(self, rows: int) -> Kernel:
        return self._by_rows[rows] if rows < len(self._by_rows) else LINEAR


def invariance_pays(tables: list[KernelTable], counts: list[int]) -> bool:
    """Whether a pass running the linears of `tables`, each `counts` times, takes the invariant families: their
    seconds over the fastest kernels' for the whole pass, averaged over the row buckets, at most `INVARIANCE_PAYS`
    (one table alone: its own mean price). `SPECDEC_WIDTH_INVARIANT=1`: at any price; `=0`: never."""
    chosen = settings.current().width_invariant
    if chosen is not None:
        return chosen
    buckets = sorted(set.intersection(*(set(table.seconds) for table in tables))) if tables else []
    prices = [sum(c * t.seconds[b][0] for c, t in zip(counts, tables, strict=True))
              / sum(c * t.seconds[b][1] for c, t in zip(counts, tables, strict=True)) for b in buckets]
    return (sum(prices) / len(prices) if prices else 1.0) <= INVARIANCE_PAYS


@cache
def kernel_table(shape: tuple[int, int], dtype: torch.dtype, device: str = "cpu") -> KernelTable:
    """The measured table for weights of `shape` (out, in) in `dtype` here: from this process, from the disk
    cache, or measured now."""
    if dtype == torch.float64 or device != "cpu":
        return KernelTable({bucket: {"fastest": LINEAR, "invariant": LINEAR} for bucket in BUCKETS})
    path = choice_path(shape, dtype)
    try:
        return KernelTable({int(bucket): entry for bucket, entry in json.loads(path.read_text()).items()})
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        pass
    table = _measure(shape, dtype, device)
    write_cached(path, lambda file: file.write_text(json.dumps({str(bucket): entry for bucket, entry in table.items()})))
    return KernelTable(table)


@cache
def q4_in_pieces(in_features: int, dtype: torch.dtype) -> bool:
    """Whether a 4-bit weight of `in_features` inputs multiplies a prompt's rows (more than `native.MAX_ROWS`) of
    `dtype` by our 4-bit kernel, MAX_ROWS rows a call (every row the bits it gets alone, whatever the pass's width),
    rather than dequantized into torch's GEMM (`native.gemm_q4`): the kernel wherever it
    costs at most `INVARIANCE_PAYS` of torch's time over `Q4_PROBE`'s rows, measured once per machine (tenths of a
    second), as the invariant kernels are chosen; `SPECDEC_WIDTH_INVARIANT=1` the kernel at any price, `=0` torch's.
    On a 2-vCPU Zen 4 (VNNI, no AMX) the kernel took 0.28-0.74 of torch's time over 64 to 709 rows (twenty-second
    round, docs/results.md); AMX's tiles may turn that."""
    chosen = settings.current().width_invariant
    if chosen is not None:
        return chosen
    path = choice_path((Q4_PROBE[1], in_features), dtype, kind="q4 pieces")
    try:
        return bool(json.loads(path.read_text())["pieces"])
    except (OSError, ValueError, TypeError, KeyError):
        pass
    seconds = _measure_q4(in_features, dtype)
    pieces = seconds["pieces"] <= INVARIANCE_PAYS * seconds["dequantized"]
    write_cached(path, lambda file: file.write_text(json.dumps({"pieces": pieces, "seconds": seconds})))
    return pieces


def q4_product(x: Tensor, packed: Tensor, scales_minimums: Tensor, out_features: int, bias: Tensor | None) -> Tensor:
    """x (rows, in) times a 4-bit weight (`native.gemm_q4`), a prompt's many rows as `q4_in_pieces` measured here."""
    pieces = x.shape[0] > native.MAX_ROWS and q4_in_pieces(x.shape[1], x.dtype)
    return native.gemm_q4(x, packed, scales_minimums, out_features, bias, pieces=pieces)


def _measure_q4(in_features: int, dtype: torch.dtype) -> dict[str, float]:
    """Seconds of a pass over `Q4_PROBE`'s rows each way, the best of four, on a random 4-bit weight."""
    rows, out = Q4_PROBE
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (out, in_features), dtype=torch.uint8, generator=generator)
    scales = torch.rand(out, in_features // native.Q4_BLOCK, generator=generator) / 64
    packed, scales_minimums = native.pack_q4(q, scales, -8 * scales)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    seconds = {}
    for name, pieces in (("pieces", True), ("dequantized", False)):
        best = float("inf")
        for _ in range(REPEATS + 2):
            start = time.perf_counter()
            native.gemm_q4(x, packed, scales_minimums, out, pieces=pieces)
            best = min(best, time.perf_counter() - start)
        seconds[name] = best
    return seconds


def choice_path(shape: tuple[int, ...], dtype: torch.dtype, kind: str = "table") -> Path:
    """Where the table of `shape` in `dtype` is kept (or another `kind` of measured choice: the 4-bit prompt's,
    `flash.chosen`'s): one file per machine, thread count, torch and this code."""
    key = {"shape": list(shape), "dtype": str(dtype), "threads": torch.get_num_threads(), "torch": torch.__version__,
           "cpu": torch.backends.cpu.get_cpu_capability(), "code": _CODE,
           "machine": _cpu_name(), **({"kind": kind} if kind != "table" else {})}
    return cache_dir() / "kernels" / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20] + ".json")


def prepare(weights: list[Tensor]) -> None:
    """Measure the tables of `weights`' shapes not measured yet, with a progress bar on stderr (seconds, once per
    machine and model shape; `SPECDEC_PROGRESS=0` hides it)."""
    wanted = sorted({(tuple(w.shape), w.dtype, w.device.type) for w in weights}, key=str)
    new = [w for w in wanted if w[1] != torch.float64 and w[2] == "cpu" and not choice_path(w[0], w[1]).exists()]
    bar = tqdm(wanted, desc="Choosing GEMM kernels here (once)", unit="shape", leave=False, file=sys.stderr,
               disable=not settings.current().progress or not new)
    for shape, dtype, device in bar:
        kernel_table(shape, dtype, device)


def _cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    except OSError:
        return ""
