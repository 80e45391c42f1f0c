"""The console's models: loading them, which installed drafter fits a target, and running a method."""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.text import Text

from console.settings import Settings
from ngram_assisted import ngram_assisted_speculative_generate
from ngram_assisted import ngram_assisted_speculative_generate_encoder_decoder as nasd_ed
from sampling import (
    PromptCache,
    SpeculativeStats,
    autoregressive_generate,
    autoregressive_generate_encoder_decoder,
    beam_search_generate,
    speculative_generate,
    speculative_generate_encoder_decoder,
)
from sampling.drafters.self_drafting import self_drafter
from sampling.drafters.self_kind import DEFAULT_BITS, SELF
from utils.calibration import is_measured, pass_costs
from utils.loading import end_token_ids, load_model
from utils.offline_models import installed_models, offline_model
from utils.quantized_models import check_quantization, drafter_group
from utils.runners.model_info import is_encoder_decoder

# A real target and the drafter of its family that shares its tokenizer (`make models` installs both).
DRAFTERS = {"qwen2.5-coder-1.5b-instruct": "qwen2.5-coder-0.5b-instruct"}
PAIR_COMMAND = "make chat-coder"  # the console on that pair
# Where no real drafter is installed: a bfloat16 copy of the target, as the README's snippet uses.
# It shares the target's tokenizer and mostly its argmax, so speculative decoding can be watched at
# work (alpha, tau, /debug); it is no smaller than the target, so it brings no speed-up.
STAND_IN = "stand-in"
STAND_IN_WHAT = "a bfloat16 copy of the target, to watch speculative decoding at work (not smaller: no speed-up)"


@dataclass
class Model:
    """A loaded model, its tokenizer and the name it was loaded by (None: the built-in model)."""

    model: torch.nn.Module
    tokenizer: object
    name: str | None
    four_bit: torch.nn.Module | None = None  # its own weights in four bits, once `/self` built them (`own_drafter`)

    @property
    def label(self) -> str:
        return self.name or "the built-in SmolLM2-135M-Instruct"

    @property
    def short_name(self) -> str | None:
        """The offline model's short name (`utils.offline_models`), or None for a folder or Hub name."""
        offline = offline_model(self.name)
        return offline.name if offline is not None else None

    @property
    def encoder_decoder(self) -> bool:
        return is_encoder_decoder(self.model)

    @property
    def end_tokens(self) -> list[int]:
        return end_token_ids(self.model, self.tokenizer)


def stand_in(target: Model) -> Model:
    """The built-in stand-in drafter for `target` (`STAND_IN_WHAT`)."""
    left_out = {id(target.four_bit): None} if target.four_bit is not None else {}  # `/self`'s copy, kept on the model
    model = copy.deepcopy(target.model, left_out).to(torch.bfloat16).eval()
    return Model(model, target.tokenizer, f"{STAND_IN} (a bfloat16 copy of {target.label})")


def load(name: str | None, options: dict, console: Console, role: str = "model") -> Model:
    """Load a model by short name, folder or Hub name, with a spinner (errors raise, from `load_model`)."""
    label = name or "the built-in SmolLM2-135M-Instruct"
    offline = offline_model(name)
    first = offline is not None and not (offline.folder / "config.json").exists()
    if first:  # `utils.offline_models.model_folder` builds it, with its own progress bars
        console.print(first_load_message(offline), markup=False, highlight=False, soft_wrap=True)
    with console.status(f"Loading {role} {label}..."):
        model, tokenizer = load_model(name, **options)
    return Model(model, tokenizer, name)


def first_load_message(offline) -> str:
    """What the first load of an offline model does, and how long it takes, by its size: the
    built-in 135M model (98 MB) took 22 s on a quiet 2-core machine; the Qwen models take minutes."""
    size = offline.size_bytes / 1e6
    wait = "under a minute on a quiet machine" if size < 200 else "a few minutes"
    return (f"First load of {offline.name}: de-quantizing its {size:,.0f} MB once into the cache ({wait}; "
            f"later loads take seconds).")


def measure_pass_costs(console: Console, models: list[Model]) -> None:
    """The first run on a machine measures what a forward pass costs (`utils.calibration`): say so
    and show its progress (stderr) now, rather than stall silently on the first prompt."""
    for model in models:
        if not is_measured(model.model):
            console.print(Text(f"First run with {model.label} here: measuring what a forward pass costs on this "
                               "machine (cached; about 10-30 s for a 135M model).", style="yellow"))
            pass_costs(model.model)


def other_tokenizers_supported() -> bool:
    """Whether speculative decoding takes a drafter with its own tokenizer (`drafter_tokenizer=`)."""
    return "drafter_tokenizer" in inspect.signature(speculative_generate).parameters


def same_tokenizer(a, b) -> bool:
    return a is b or a.get_vocab() == b.get_vocab()


def check_pair(target: Model, drafter: Model) -> None:
    """Raise a one-line ValueError when `drafter` cannot draft for `target`."""
    if drafter.encoder_decoder != target.encoder_decoder:
        raise ValueError(f"{drafter.label} and {target.label} must both be decoder-only or both encoder-decoder")
    if same_tokenizer(target.tokenizer, drafter.tokenizer):
        return
    if target.encoder_decoder or not other_tokenizers_supported():
        raise ValueError(f"{drafter.label} does not share the tokenizer of {target.label}: {drafter_hint(target)}")
    from sampling.drafters.universal import check_tokenizers  # the checks speculative decoding runs, before any model runs

    check_tokenizers(target.tokenizer, drafter.tokenizer, drafter.model, target.model, encoder_decoder=False)


def check_self(target: Model) -> None:
    """Raise a one-line ValueError when the target cannot draft for itself in four bits (the checks the
    self-drafter runs before any model runs): an encoder-decoder target, linears off the CPU or already quantized."""
    if target.encoder_decoder:
        raise ValueError(f"/self drafts for decoder-only targets: {target.label} is an encoder-decoder model")
    try:
        check_quantization(target.model, DEFAULT_BITS, drafter_group(target.model))
    except ValueError as error:
        raise ValueError(f"/self cannot draft with {target.label}'s four-bit copy: {error}") from None


def own_drafter(console: Console, target: Model) -> torch.nn.Module:
    """The target's four-bit copy that `/self` drafts with, the one its runs build and keep (`self_drafter`): built
    by the first call, which says so (seconds on a real model; the library's progress bar on stderr) and measures its
    passes, rather than stall on the next prompt."""
    if target.four_bit is None:
        check_self(target)
        console.print(Text(f"Building {target.label}'s four-bit copy to draft with (once; seconds on a real model).",
                           style="yellow"))
        target.four_bit = self_drafter(target.model, DEFAULT_BITS)
        measure_pass_costs(console, [Model(target.four_bit, target.tokenizer, f"{target.label}'s four-bit copy")])
    return target.four_bit


def drafter_hint(target: Model, installed: list[str] | None = None) -> str:
    """One line: how to get a drafter for `target` here (load the installed one, or install a pair)."""
    installed = installed_models() if installed is None else installed
    drafter = DRAFTERS.get(target.short_name)
    stand_in_offer = f"/load drafter {STAND_IN} loads the built-in stand-in: {STAND_IN_WHAT}"
    if drafter in installed:
        return f"load its drafter with /load drafter {drafter}"
    if drafter is not None:
        return f"its drafter {drafter} is not installed: run make models, then /load drafter {drafter}"
    pair = next(((t, d) for t, d in DRAFTERS.items() if t in installed and d in installed), None)
    if pair is not None:
        return (f"no installed drafter shares this model's tokenizer; {stand_in_offer}; or try the real pair: "
                f"/load target {pair[0]}, then /load drafter {pair[1]} (or {PAIR_COMMAND})")
    return (f"no real drafter is installed here; {stand_in_offer}; make models installs a real pair, "
            f"Qwen2.5-Coder-1.5B and its 0.5B drafter (1.6 GB, offline afterwards), then {PAIR_COMMAND}")


def run_method(method: str, inputs: list[int], s: Settings, *, target: Model, drafter: Model | None, pool,
               on_step, prompt_cache: PromptCache | None = None) -> tuple[list[int], SpeculativeStats | None]:
    """Run one of the console's methods with its settings -> (generated ids, stats or None). `prompt_cache`: the
    method's kept keys from its last answer (beam search reads its prompt whole)."""
    generator = torch.Generator().manual_seed(s.seed) if s.seed is not None else None
    common = dict(max_gen_len=s.max_gen_len, end_tokens_id=target.end_tokens, use_cache=s.use_cache)
    sampling = dict(logits_processor=s.processor, generator=generator, on_step=on_step, prompt_cache=prompt_cache)
    encoder_decoder = target.encoder_decoder
    if method in ("speculative", "drafter") and drafter is None:
        raise ValueError(f"/{method} needs a drafter model: {drafter_hint(target)}")
    if method == "self":
        check_self(target)
    if method in ("target", "drafter"):
        fn = autoregressive_generate_encoder_decoder if encoder_decoder else autoregressive_generate
        model = target.model if method == "target" else drafter.model
        return fn(inputs, model, **common, **sampling), None
    if method == "beam":
        return beam_search_generate(inputs, target.model, **common, num_beams=4, top_k=3), None
    stats = SpeculativeStats()
    if method == "speculative":
        fn = speculative_generate_encoder_decoder if encoder_decoder else speculative_generate
        tokenizers = {}
        if not same_tokenizer(target.tokenizer, drafter.tokenizer):  # allowed by `check_pair` only when supported
            tokenizers = dict(tokenizer=target.tokenizer, drafter_tokenizer=drafter.tokenizer)
        ids, _ = fn(inputs, drafter.model, target.model, gamma=s.gamma, stats=stats, **tokenizers, **common, **sampling)
    elif method == "self":  # the cost-aware policy: it drafts only where drafting pays
        ids, _ = speculative_generate(inputs, SELF, target.model, gamma=s.gamma, adaptive_gamma=True, bits=DEFAULT_BITS,
                                      stats=stats, **common, **sampling)
    else:
        fn = nasd_ed if encoder_decoder else ngram_assisted_speculative_generate
        ids, _ = fn(inputs, pool, target.model, gamma=s.gamma, top_k_filler=s.top_k_filler,
                    stop_if_unknown=s.stop_if_unknown, branching=s.branching, stats=stats, **common, **sampling)
    return ids, stats
