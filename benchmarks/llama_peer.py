"""llama.cpp as a benchmark peer, through llama-cpp-python (`make peers` builds it; the library never needs it).

    peer, why = load_peer("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", n_ctx=2048, threads=2)
    peer.methods                                     # ("llama_plain", "llama_prompt_lookup", "llama_draft")
    peer.generate("llama_plain", ids, max_new_tokens=64, end_tokens=[151645])   # greedy, the generated ids

It runs the GGUF files the offline models are assembled from (`utils/offline_models.py`): the file itself for a model
shipped whole, else the parts concatenated (sha256 checked) into `cache_dir()/gguf/` once. Its methods, greedy
(temperature 0, llama.cpp's greedy sampler, no repetition penalty), each run from an empty KV cache (no prefix reuse
across runs: every run prefills its prompt, as ours do):

- `llama_plain`: `Llama.generate`, one token a pass;
- `llama_prompt_lookup`: the binding's `LlamaPromptLookupDecoding` as `draft_model=` (its defaults: n-grams of 2 tokens
  at most, 10 tokens drafted), verified by `Llama.generate`'s speculative loop;
- `llama_draft` (with a drafter): the binding exposes no draft-model speculation, only that `draft_model=` hook; here
  `ModelDraft` fills it with a second `Llama` (the drafter's GGUF) drafting greedily as llama.cpp's own draft-simple
  speculation does (common/speculative.cpp: up to `n_max` tokens, stopping below `p_min`; its defaults 3 and 0.0).

A peer is anything with `methods`, `weights` (a line naming its weight format) and `generate`; the benchmark's tests
use a fake one.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from benchmarks.gguf_types import weight_types
from utils.offline_models import OFFLINE_MODELS, assemble, missing_message, offline_model
from utils.paths import cache_dir

PACKAGE = "llama-cpp-python==0.3.36"  # what `make peers` builds (CPU only)
PROMPT_LOOKUP = dict(max_ngram_size=2, num_pred_tokens=10)  # LlamaPromptLookupDecoding's defaults
DRAFT_MAX, DRAFT_P_MIN = 3, 0.0  # llama.cpp's draft-simple defaults (common/common.h, vendored in 0.3.36)
GREEDY = dict(temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
PROBE = ("import sys, llama_cpp\n"
         "llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, verbose=False)\n"
         "llm.create_completion(llm.tokenize(b'def f():'), max_tokens=2, temperature=0.0)\n")


def gguf_file(name: str | None) -> Path:
    """The GGUF file of offline model `name`: shipped whole, or assembled once into `cache_dir()/gguf/`.
    Raises FileNotFoundError (one line) for a name that is no offline model or one not installed."""
    model = offline_model(name)
    if model is None:
        raise FileNotFoundError(f"{name!r} has no GGUF file here: llama.cpp runs the offline models only "
                                f"({', '.join(OFFLINE_MODELS)})")
    if not model.installed():
        raise FileNotFoundError(missing_message(model))
    paths = model.part_paths()
    if len(paths) == 1 and model.sha256 is None:
        return paths[0]
    folder = cache_dir() / "gguf"
    if not (folder / model.gguf).exists():
        folder.mkdir(parents=True, exist_ok=True)
        assemble(model, folder)  # written beside, checked, then renamed: never half a file
    return folder / model.gguf


def decodes(path: Path, timeout: float = 600) -> str:
    """"" when llama.cpp loads `path` and decodes two tokens in a child process, else one line saying how it ended:
    a build that crashes on its first decode (as ggml's AMX matmul does on some Xeons) would end the benchmark."""
    try:
        done = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"a first decode of {path.name} took over {timeout:.0f} s"
    if done.returncode == 0:
        return ""
    if done.returncode < 0:
        return (f"a first decode of {path.name} ended with signal {-done.returncode} (a build for another CPU? "
                "pip uninstall llama-cpp-python, then make peers)")
    last = (done.stderr.strip().splitlines() or [""])[-1][:160]
    return f"a first decode of {path.name} ended with exit status {done.returncode}{': ' + last if last else ''}"


class ModelDraft:
    """A `draft_model=` for `Llama`: a second `Llama` (the drafter) drafting greedily from the ids so far, its own KV
    cache kept across calls (the common prefix reused), up to `n_max` tokens, stopping at one whose probability is
    below `p_min` (not drafted), as llama.cpp's draft-simple does."""

    def __init__(self, drafter, n_max: int = DRAFT_MAX, p_min: float = DRAFT_P_MIN) -> None:
        if n_max < 1:
            raise ValueError(f"n_max must be >= 1, got {n_max}")
        self.drafter, self.n_max, self.p_min = drafter, n_max, p_min

    def _last_logits(self) -> np.ndarray:
        drafter = self.drafter
        return np.ctypeslib.as_array(drafter._ctx.get_logits_ith(-1), shape=(drafter.n_vocab(),))

    def __call__(self, input_ids, /, **kwargs) -> np.ndarray:
        drafter, ids = self.drafter, [int(t) for t in input_ids]
        cached = drafter.input_ids[: drafter.n_tokens].tolist()
        prefix = next((i for i, (a, b) in enumerate(zip(cached, ids, strict=False)) if a != b), min(len(cached), len(ids)))
        drafter.n_tokens = min(prefix, len(ids) - 1)  # the last id is fed again: its logits draft the first token
        drafter.eval(ids[drafter.n_tokens:])
        drafts: list[int] = []
        while len(drafts) < self.n_max:
            logits = self._last_logits()
            token = int(np.argmax(logits))
            if 1.0 / float(np.exp(logits - logits[token]).sum()) < self.p_min:  # its probability: not confident enough
                break
            drafts.append(token)
            if len(drafts) < self.n_max:
                drafter.eval([token])
        return np.array(drafts, dtype=np.intc)


class LlamaCppPeer:
    """llama.cpp's methods on one target GGUF (and a drafter's): one `Llama` per method (the speculative ones keep
    every position's logits, which plain decoding need not), the file memory-mapped once by the system."""

    def __init__(self, llama_cpp, target: Path, drafter: Path | None, *, n_ctx: int, threads: int,
                 draft_max: int = DRAFT_MAX) -> None:
        common = dict(model_path=str(target), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
        lookup = llama_cpp.llama_speculative.LlamaPromptLookupDecoding(**PROMPT_LOOKUP)
        # A speculative Llama keeps every position's logits whatever `logits_all` says, but sizes their array by it:
        # n_batch rows (512) unless told, so a prompt past 512 tokens failed to broadcast in its `eval` (0.3.36).
        speculative = {**common, "logits_all": True}
        self.models = {"llama_plain": llama_cpp.Llama(**common),
                       "llama_prompt_lookup": llama_cpp.Llama(**speculative, draft_model=lookup)}
        if drafter is not None:
            small = llama_cpp.Llama(**{**common, "model_path": str(drafter)})
            self.models["llama_draft"] = llama_cpp.Llama(**speculative, draft_model=ModelDraft(small, n_max=draft_max))
        self.methods = tuple(self.models)
        self.weights = weight_types(target)
        self.drafter_weights = weight_types(drafter) if drafter is not None else None

    def generate(self, method: str, ids: list[int], max_new_tokens: int, end_tokens: list[int]) -> list[int]:
        """Greedy: the generated ids, through the first end token, `max_new_tokens` at most."""
        llm = self.models[method]
        llm.reset()  # an empty cache: generate would otherwise reuse the previous run's prompt
        out: list[int] = []
        for token in llm.generate(ids, **GREEDY):
            out.append(int(token))
            if out[-1] in end_tokens or len(out) >= max_new_tokens:
                break
        return out


def load_peer(target: str | None, drafter: str | None, *, n_ctx: int, threads: int, draft_max: int = DRAFT_MAX,
              probe=decodes) -> tuple[LlamaCppPeer | None, str]:
    """(the peer, "") or (None, one line saying why not: no binding, no GGUF file, a crashing or failed load; `probe`
    says first whether a child process decodes the file). A drafter with no GGUF file leaves the peer without
    `llama_draft` (said in the line)."""
    try:
        import llama_cpp
        import llama_cpp.llama_speculative  # noqa: F401  (the prompt-lookup draft model)
    except ImportError as error:
        return None, f"llama.cpp skipped: llama-cpp-python is not installed ({error}); run  make peers"
    try:
        path = gguf_file(target)
    except (FileNotFoundError, ValueError) as error:
        return None, f"llama.cpp skipped: {error}"
    if why := probe(path):
        return None, f"llama.cpp skipped: {why}"
    note, draft_path = "", None
    if drafter is not None:
        try:
            draft_path = gguf_file(drafter)
        except (FileNotFoundError, ValueError) as error:
            note = f"llama.cpp's draft-model speculation skipped: {error}"
    try:
        return LlamaCppPeer(llama_cpp, path, draft_path, n_ctx=n_ctx, threads=threads, draft_max=draft_max), note
    except (ValueError, RuntimeError, OSError) as error:  # the binding raises ValueError for a file it cannot load
        return None, f"llama.cpp skipped: {path} did not load ({error})"
