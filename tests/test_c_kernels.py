"""The native kernels (utils/lean/*.c) in C, without Python: tests/native/test_kernels.c built by tests/native/run.sh
with each compiler and ISA there is a toolchain for, checked against its scalar references (tolerances, width
invariance to the bit, out-of-range slots refused), fuzzed under AddressSanitizer and UBSan, and the builds' outputs
compared where their steps are the same (`digest`: the 4-bit GEMM and dequantization, RMSNorm and the rotary step in
every build; the bfloat16 GEMM's plain C version gives AVX2's bits).

A variant whose toolchain is missing (compiler, OpenMP runtime, sanitizer runtime, qemu and the aarch64 sysroot) is
skipped with the reason, or fails where SPECDEC_REQUIRE_NATIVE=1 (CI, where every toolchain must be there)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import missing_native

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "tests" / "native" / "run.sh"
X86 = platform.machine() in ("x86_64", "AMD64")
NATIVE = "-march=native" if X86 else "-mcpu=native"  # aarch64's gcc and clang name the host's CPU with -mcpu
SANITIZE = ["-O1", "-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"]
QEMU = ["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu"]


@dataclass(frozen=True)
class Variant:
    name: str
    cc: str
    flags: tuple[str, ...]
    runner: tuple[str, ...] = ()
    cpu: frozenset[str] = field(default_factory=frozenset)  # /proc/cpuinfo flags the build needs to run here
    x86_only: bool = False


HASWELL = frozenset({"avx2", "fma", "f16c", "bmi2", "movbe"})
AVX512 = HASWELL | {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}
VARIANTS = {v.name: v for v in (
    Variant("gcc-native", "gcc", (NATIVE, "-fopenmp")),
    Variant("clang-native", "clang", (NATIVE, "-fopenmp")),
    # an AVX2-only CPU's code, tuned for a Zen 3 (whose tuning left a loop's running sum unfused before GCC_FLAGS)
    Variant("gcc-haswell", "gcc", ("-march=haswell", "-mtune=znver3", "-fopenmp"), cpu=HASWELL, x86_only=True),
    # AVX-512 before bfloat16 arithmetic (Skylake-SP, Cascade and Ice Lake servers): the GEMM's float32 chain on
    # AVX-512 for bfloat16 activations too, the 4-bit kernel by AVX-512 VNNI, or by AVX2's maddubs without VNNI
    Variant("gcc-avx512-no-bf16", "gcc", ("-march=cascadelake", "-fopenmp"), cpu=AVX512 | {"avx512_vnni"},
            x86_only=True),
    Variant("gcc-avx512-no-vnni", "gcc", ("-march=skylake-avx512", "-fopenmp"), cpu=AVX512, x86_only=True),
    # AVX-VNNI (Alder Lake and later desktops): the 4-bit kernel's vpdpbusd on 256 bits, here in its AVX-512 VL
    # encoding (gemm_q4_avx2.c, Q4_AVX_VNNI_AS_EVEX): no CPU or emulator here runs the VEX one
    Variant("gcc-avx-vnni-as-evex", "gcc", ("-march=haswell", "-mavx512f", "-mavx512vl", "-mavx512vnni",
                                            "-DQ4_AVX_VNNI_AS_EVEX", "-fopenmp"),
            cpu=HASWELL | {"avx512f", "avx512vl", "avx512_vnni"}, x86_only=True),
    Variant("gcc-avx-no-avx2", "gcc", ("-march=sandybridge", "-fopenmp"), cpu=frozenset({"avx"}), x86_only=True),
    Variant("gcc-x86-64-no-openmp", "gcc", ("-march=x86-64",), x86_only=True),  # plain C, OpenMP's pragmas ignored
    Variant("clang-x86-64-no-openmp", "clang", ("-march=x86-64",), x86_only=True),
    Variant("gcc-sanitizers", "gcc", (NATIVE, "-fopenmp", *SANITIZE)),
    Variant("clang-sanitizers", "clang", (NATIVE, "-fopenmp", *SANITIZE)),
    Variant("aarch64-gcc-qemu", "aarch64-linux-gnu-gcc", ("-march=armv8-a", "-fopenmp"), runner=tuple(QEMU)),
)}


def _cpu_flags() -> set[str]:
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


def _environment(policy: str = "passive") -> dict[str, str]:
    """OpenMP's idle threads sleep (`policy` passive) or spin (active): attention.c forms its teams of threads from
    fewer keys where they spin (`threads_sleep`)."""
    return {**os.environ, "OMP_WAIT_POLICY": policy, "RUNNER": " ".join(QEMU)}


def _toolchain(variant: Variant, scratch: Path) -> None:
    """Skip (or fail) unless this machine can build and run `variant`: its compiler, its flags' runtimes (a trivial
    program built with them), qemu where it runs under one, a CPU with the ISA it is built for."""
    if variant.x86_only and not X86:
        pytest.skip(f"{variant.name} is an x86-64 build; this machine is {platform.machine()}")
    if shutil.which(variant.cc) is None:
        missing_native(f"no {variant.cc} on PATH (the {variant.name} build)")
    if variant.runner and shutil.which(variant.runner[0]) is None:
        missing_native(f"no {variant.runner[0]} to run the {variant.name} build")
    if variant.runner and not Path(variant.runner[-1]).is_dir():
        missing_native(f"no {variant.runner[-1]} (the aarch64 C library: libc6-dev-arm64-cross) for {variant.name}")
    lacking = variant.cpu - _cpu_flags()
    if lacking:
        pytest.skip(f"this CPU lacks {', '.join(sorted(lacking))} for the {variant.name} build")
    probe = scratch / "probe.c"
    probe.write_text("#include <math.h>\nint main(void) { return (int)sqrt(0.0); }\n")
    built = subprocess.run([variant.cc, *variant.flags, str(probe), "-o", str(scratch / "probe"), "-lm"],
                           capture_output=True, text=True, timeout=120)
    if built.returncode != 0:
        missing_native(f"{variant.cc} {' '.join(variant.flags)} cannot build a trivial program (a runtime missing: "
                 f"libomp-dev for clang's OpenMP, the sanitizers' libraries): {built.stderr.strip()[-300:]}")
    ran = subprocess.run([*variant.runner, str(scratch / "probe")], capture_output=True, text=True, timeout=120)
    if ran.returncode != 0:
        missing_native(f"a trivial {variant.name} program does not run: {ran.stderr.strip()[-300:]}")


_BUILT: dict[str, Path] = {}


def _binary(name: str, tmp_path_factory) -> Path:
    """The variant's test_kernels, built once a session (run.sh builds, then runs its `check`, which must pass)."""
    if name not in _BUILT:
        variant = VARIANTS[name]
        out = tmp_path_factory.mktemp(name)
        _toolchain(variant, out)
        env = {**_environment(), "RUNNER": " ".join(variant.runner)}
        result = subprocess.run(["sh", str(RUN), variant.cc, str(out), *variant.flags, "--", "check"], env=env,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{name}: check failed\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
        assert ", 0 failures" in result.stdout, result.stdout
        _BUILT[name] = out / "test_kernels"
    return _BUILT[name]


def _run(name: str, binary: Path, *arguments: str, policy: str = "passive") -> str:
    result = subprocess.run([*VARIANTS[name].runner, str(binary), *arguments], env=_environment(policy),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{name} {' '.join(arguments)}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result.stdout


def _params(names):
    """The builds as test parameters: the machine's own with gcc in `make test`, every other one `portable` (`make
    test-portable`, CI)."""
    return [pytest.param(name, marks=[] if name == "gcc-native" else [pytest.mark.portable], id=name) for name in names]


@pytest.mark.parametrize("name", _params(VARIANTS))
def test_each_build_matches_the_scalar_references_and_gives_each_row_its_bits_at_any_width(name, tmp_path_factory):
    """`check` (run by the build) then a short fuzz: every entry point within its tolerance of the references, each
    row's bits the same alone and among 32, on 1 to 4 threads, refusals by their named status; the fuzz again with
    spinning threads (attention's teams of threads on short buffers too)."""
    binary = _binary(name, tmp_path_factory)
    assert ", 0 failures" in _run(name, binary, "fuzz", "300")
    assert ", 0 failures" in _run(name, binary, "fuzz", "300", "3", policy="active")


@pytest.mark.portable
@pytest.mark.parametrize("name", ["gcc-sanitizers", "clang-sanitizers"])
def test_ten_thousand_random_calls_per_entry_point_are_clean_under_the_sanitizers(name, tmp_path_factory):
    binary = _binary(name, tmp_path_factory)
    assert ", 0 failures" in _run(name, binary, "fuzz", "10000", "7")
    assert ", 0 failures" in _run(name, binary, "fuzz", "1000", "8", policy="active")


def _digest(name: str, tmp_path_factory) -> dict[str, str]:
    lines = _run(name, _binary(name, tmp_path_factory), "digest").splitlines()
    block = int(lines[0].split()[1])
    return {"block": block, **{line.split()[1]: line.split()[2] for line in lines[1:]}}


@pytest.mark.parametrize("other", _params(["gcc-x86-64-no-openmp", "gcc-haswell", "clang-native", "aarch64-gcc-qemu",
                                            "gcc-avx512-no-bf16", "gcc-avx512-no-vnni", "gcc-avx-vnni-as-evex",
                                            "gcc-avx-no-avx2"]))
def test_builds_give_the_same_bits_where_their_steps_are_the_same(other, tmp_path_factory):
    """The 4-bit GEMM and its dequantization (integer sums, then the same float32 steps per lane), RMSNorm and the
    rotary step: the same bits in every build; the bfloat16 GEMM in builds of the same block (plain C takes AVX2's
    steps lane for lane; AVX-512's 32-wide blocks sum in another order)."""
    mine, theirs = _digest("gcc-native", tmp_path_factory), _digest(other, tmp_path_factory)
    for kernel in ("gemm_q4", "dequantize_q4", "rms_norm", "rope_write"):
        assert mine[kernel] == theirs[kernel], kernel
    if mine["block"] == theirs["block"]:
        assert mine["gemm"] == theirs["gemm"]
    else:
        reference = _digest("gcc-x86-64-no-openmp", tmp_path_factory) if X86 and other != "gcc-x86-64-no-openmp" else None
        if reference is not None and reference["block"] == theirs["block"]:
            assert reference["gemm"] == theirs["gemm"]


# CPUs this machine cannot run, built here to check that their kernel is the one compiled: (-march, the file, an
# instruction its kernel takes, one it must not). Alder Lake (AVX-VNNI, no AVX-512): the 4-bit kernel's VEX vpdpbusd,
# the steps "gcc-avx-vnni-as-evex" runs; Sapphire Rapids: the tile kernel (clang names the tile extensions otherwise
# than gcc, and its builds once left it out).
UNRUNNABLE = {
    "alderlake": ("gemm_q4_avx2.c", "{vex} vpdpbusd", "vpmaddubsw"),
    "sapphirerapids": ("gemm_amx.c", "tdpbf16ps", None),
}


@pytest.mark.portable
@pytest.mark.parametrize("cc", ["gcc", "clang"])
@pytest.mark.parametrize("march", sorted(UNRUNNABLE))
def test_a_build_for_a_cpu_not_here_compiles_its_own_kernel(march, cc, tmp_path):
    if not X86:
        pytest.skip(f"an x86-64 build; this machine is {platform.machine()}")
    for tool in (cc, "objdump"):
        if shutil.which(tool) is None:
            missing_native(f"no {tool} on PATH")
    source, wanted, unwanted = UNRUNNABLE[march]
    lean = ROOT / "utils" / "lean"
    built = subprocess.run([cc, "-O3", f"-march={march}", "-ffp-contract=off", "-c", str(lean / source), f"-I{lean}",
                            "-o", str(tmp_path / "kernel.o")], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr[-2000:]
    code = subprocess.run(["objdump", "-d", str(tmp_path / "kernel.o")], capture_output=True, text=True,
                          timeout=60).stdout
    assert wanted in code, f"{cc} -march={march}: no {wanted} in {source}'s code"
    assert unwanted is None or unwanted not in code, f"{cc} -march={march}: {unwanted} in {source}'s code"
