"""A model's linears in 8 or 4 bits (`utils/quantize.py`), built once per model and machine and kept
under `SPECDEC_CACHE` (`utils.paths.cache_dir`): a later start loads the packed weights instead of
quantizing again.

The cache key: the model's class, config and a fingerprint of its weights (each tensor's sum and a strided sample of every
tensor, so a fine-tuned copy of the same architecture is another key), the bits and group size, the
CPU's vector capability and torch's version (the int4 packing is the kernel's own layout), and this
code's source.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from utils import settings
from utils.lean import forget, native
from utils.paths import cache_dir, write_cached
from utils.quantize import BITS, QuantizedLinear, linear_weight, quantized_linear

__all__ = ["QUANTIZE_KINDS", "check_quantization", "install", "linear_names", "quantize_linears", "quantize_model",
           "quantized_state_key"]

PROGRESS_ENV = settings.PROGRESS_ENV  # "0": no progress bar while quantizing
CACHE_MIN_PARAMETERS = 10_000_000  # cache="auto": smaller models quantize faster than they load
SAMPLE = 4096  # elements of each tensor in the fingerprint
GROUP_SIZES = (32, 64, 128, 256)  # what torch's int4 CPU kernel is used with (gpt-fast's choices)
QUANTIZE_KINDS = {"int8": (8, 32), "int4": (4, 32)}  # `load_model(quantize=)`: (bits, group size)


def linear_names(model: nn.Module) -> list[str]:
    """The qualified names of every linear of `model` (`nn.Linear`, transformers' `Conv1D`)."""
    return [name for name, module in model.named_modules() if linear_weight(module) is not None]


def drafter_group(model: nn.Module) -> int:
    """The int4 group a self-drafter of `model` takes unless told: 64 input columns a scale and a minimum (4.5 bits a
    weight) where our 4-bit kernel runs here and takes every linear of `model` so, else 32 (5 bits). On the 1.5B
    (docs/results.md, seventeenth round) groups of 64 read 0.28 of the target's bytes against 0.31, for a tau at
    gamma 5 about 1% lower."""
    widths = _input_widths(model, linear_names(model))
    return 64 if widths and all(native.supports_q4(width, 64) for width in widths) else 32


def _input_widths(model: nn.Module, names: list[str]) -> set[int]:
    """The input widths of `model`'s linears `names`."""
    modules = dict(model.named_modules())
    return {linear_weight(modules[name]).shape[1] for name in names}


def check_quantization(model: nn.Module, bits, group_size) -> None:
    """Refuse bits other than 4 or 8 and a group size that is no int4 kernel's or divides no
    linear's input width, by name, before any work."""
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"bits must be 4 or 8 (or 'auto' where offered), got {bits!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    names = linear_names(model)
    if not names:
        already = any(isinstance(module, QuantizedLinear) for module in model.modules())
        raise ValueError(f"{type(model).__name__} has no float linear layer to quantize"
                         + (" (its linears are quantized already: n-grams draft for such a model)" if already else ""))
    modules = dict(model.named_modules())
    elsewhere = sorted({str(linear_weight(modules[name]).device) for name in names} - {"cpu"})
    if elsewhere:  # torch's int8/int4 weight-only kernels are CPU kernels
        raise ValueError(f"{type(model).__name__} has linears on {', '.join(elsewhere)}: the 4- and 8-bit kernels "
                         f"(torch's _weight_int4pack_mm_for_cpu, _weight_int8pack_mm) run on the CPU only; "
                         f"load the model on the CPU (device='cpu') to quantize it")
    widths = _input_widths(model, names)
    if bits == 4 and all(width % group_size for width in widths):
        raise ValueError(f"group_size={group_size} divides no linear's input width ({sorted(widths)}): "
                         f"choose one of {[g for g in GROUP_SIZES if any(w % g == 0 for w in widths)] or 'none'} "
                         f"or bits=8")


def _fingerprint(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict(keep_vars=True).items()):
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // SAMPLE)][:SAMPLE].float().cpu()
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(sample.numpy().tobytes())
        # Every value, once, summed a slice at a time: a float64 copy of the whole embedding at once would be the
        # peak of a later start's memory (1.9 GB for the 1.5B's, more than its 4-bit drafter).
        total = sum(float(part.sum(dtype=torch.float64)) for part in flat.split(1 << 20))
        digest.update(repr(total).encode())
    return digest.hexdigest()[:20]


def quantized_state_key(model: nn.Module, bits: int, group_size: int) -> str:
    """The name of `model`'s quantized weights in the cache (module docstring)."""
    sources = b"".join(Path(f).read_bytes() for f in (__file__, Path(__file__).with_name("quantize.py")))
    sources += native.GEMM_VERSION.encode()
    key = {
        "model": type(model).__name__,
        "config": hashlib.sha256(model.config.to_json_string(use_diff=False).encode()).hexdigest()[:16]
        if hasattr(model, "config") else None,
        "weights": _fingerprint(model),
        "bits": bits, "group_size": group_size,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "native_q4": native.supports_q4(2 * native.Q4_BLOCK, native.Q4_BLOCK),  # our 4-bit kernel's layout, or torch's
        "code": hashlib.sha256(sources).hexdigest()[:12],
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def _build(model: nn.Module, names: list[str], bits: int, group_size: int) -> dict[str, QuantizedLinear | None]:
    modules = dict(model.named_modules())
    bar = tqdm(names, desc=f"Quantizing to {bits} bits (once)", unit="linear", leave=False, file=sys.stderr,
               disable=not settings.current().progress or len(names) < 8)
    return {name: quantized_linear(modules[name], bits, group_size) for name in bar}


def _state(layers: dict[str, QuantizedLinear | None]) -> dict:
    return {name: {"bits": layer.bits, "group_size": layer.group_size, "shape": [layer.out_features, layer.in_features],
                   "weight_q": layer.weight_q, "scales": layer.scales, "kernel": layer.kernel}
            for name, layer in layers.items() if layer is not None}


def _from_state(model: nn.Module, names: list[str], state: dict) -> dict[str, QuantizedLinear | None]:
    modules, layers = dict(model.named_modules()), {}
    for name in names:
        entry = state.get(name)
        if entry is None:
            layers[name] = None
            continue
        out_features, in_features = entry["shape"]
        layers[name] = QuantizedLinear(entry["bits"], in_features, out_features, entry["weight_q"], entry["scales"],
                                       modules[name].bias, group_size=entry["group_size"],
                                       dtype=linear_weight(modules[name]).dtype, kernel=entry.get("kernel", "torch"))
    return layers


def quantize_linears(model: nn.Module, bits: int, group_size: int, *,
                     cache: bool | str = "auto") -> dict[str, QuantizedLinear | None]:
    """Every linear of `model` (checked: `check_quantization`) -> name -> its `QuantizedLinear`
    (None: it keeps its float form), `model` untouched. `cache`: keep and reuse the packed weights
    under `SPECDEC_CACHE` (True, False, or "auto": for models of `CACHE_MIN_PARAMETERS` and more)."""
    check_quantization(model, bits, group_size)
    if cache not in (True, False, "auto"):
        raise ValueError(f"cache must be True, False or 'auto', got {cache!r}")
    names = linear_names(model)
    if cache == "auto":
        cache = sum(p.numel() for p in model.parameters()) >= CACHE_MIN_PARAMETERS
    if not cache:
        return _build(model, names, bits, group_size)
    path = cache_dir() / "quantized" / f"{quantized_state_key(model, bits, group_size)}.pt"
    if path.exists():
        return _from_state(model, names, torch.load(path, weights_only=True, mmap=True))
    layers = _build(model, names, bits, group_size)
    write_cached(path, lambda file: torch.save(_state(layers), file))
    return layers


def install(model: nn.Module, layers: dict[str, QuantizedLinear | None]) -> None:
    """Put each quantized layer in its linear's place in `model` (None: the linear stays)."""
    for name, layer in layers.items():
        if layer is None:
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    forget(model)  # a lean forward built over the float linears is stale


def quantize_model(model: nn.Module, kind: str, *, cache: bool | str = "auto") -> nn.Module:
    """`model` with every linear replaced in place by its quantized form (`QUANTIZE_KINDS`: "int8" or
    "int4"; a layer the int4 kernel refuses is int8) -> `model`, now another model than the float
    one. The input embedding stays as it is; a head tied to it gets its own quantized copy."""
    if kind not in QUANTIZE_KINDS:
        raise ValueError(f"quantize must be one of {sorted(QUANTIZE_KINDS)}, got {kind!r}")
    bits, group_size = QUANTIZE_KINDS[kind]
    install(model, quantize_linears(model, bits, group_size, cache=cache))
    if hasattr(model, "config"):
        model.config.specdec_quantized = kind  # another model to the pass-cost calibration's key
    return model
