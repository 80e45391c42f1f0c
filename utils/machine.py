"""What a measured figure depends on: the machine (for reports) and, for a model's pass costs, the
key under which a calibration is cached (`utils/calibration.py`): any change of it means a new
measurement."""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path

import torch
import transformers
from transformers import PreTrainedModel

from utils import cost_model, cpu_passes, lean
from utils.lean import forward_path
from utils.runners.model_info import input_device

__all__ = ["calibration_key", "machine", "machine_key"]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """The machine that figures were measured on (for reports): CPU, vector extensions, threads,
    versions, GPU if any."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
        flags = next((set(line.split(":", 1)[1].split()) for line in cpuinfo if line.startswith("flags")), set())
    except OSError:
        flags = set()
    return {
        "cpu": _cpu_name(),
        "flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"}),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def machine_key(what: str) -> str:
    """A cache file's key for a measurement of `what` on this machine: its CPU and vector extensions, the thread
    count and torch's version (`utils.loading.fastest_dtype`)."""
    key = {"what": what, "cpu": _cpu_name(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "flags": machine()["flags"], "threads": torch.get_num_threads(), "torch": torch.__version__}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def calibration_key(model: PreTrainedModel) -> dict:
    """Everything a measured cost depends on; any change means a new calibration."""
    device = input_device(model)
    parameter = next(model.parameters())
    sources = (cpu_passes.__file__, cost_model.__file__, Path(__file__).with_name("calibration.py"),  # what times them
               *sorted(path for path in Path(lean.__file__).parent.iterdir() if path.suffix in (".py", ".c", ".h")))
    kernels = hashlib.sha256(b"".join(Path(source).read_bytes() for source in sources)).hexdigest()[:12]
    return {
        "model": type(model).__name__,
        "config": hashlib.sha256(model.config.to_json_string(use_diff=False).encode()).hexdigest()[:16],
        "dtype": str(parameter.dtype),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "device_map": str(getattr(model, "hf_device_map", None)),
        "threads": torch.get_num_threads(),
        "cpu": _cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "attention": getattr(model.config, "_attn_implementation", None),
        "kernels": kernels,
        "forward": forward_path(model),  # our own forward or the Hugging Face one (utils/lean/)
    }
