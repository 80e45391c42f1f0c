"""Forward passes of our own for the common decoder-only families, over the Hugging Face model's tensors: what
the static runner (`utils/runners/static.py`) runs for every model a family file covers, the Hugging Face model
being the reference (tests) and the fallback for every other model.

    lean_decoder(model)   the model's lean forward (built once, kept while the model lives), None: the Hugging Face path
    forward_path(model)   one line: which path the model's passes take, and why (where the lean forward's layers run
                          in Python, not in one native call: why not)

One file per family group: `llama.py` (Llama and SmolLM2, Qwen2, Qwen3, Mistral, Phi-3 and 4-mini), `gemma.py` (Gemma, Gemma 2,
Gemma 3's text model; layers of two kinds, sliding-window and full, each attend through their own mask, which the
static runner builds for our own forward only). A model dispatched by accelerate (offloaded or split over devices)
keeps the Hugging Face path: its hooks move weights per layer.
`SPECDEC_LEAN=0` turns the lean forward off (every model takes the Hugging Face path).
"""

from __future__ import annotations

import weakref

from torch import nn

from utils import settings
from utils.lean import gemma, llama, plan
from utils.lean.decoder import NativeStack

__all__ = ["LEAN_ENV", "forget", "forward_path", "kernel_plan", "lean_decoder", "unsupported"]

LEAN_ENV = settings.LEAN_ENV
_FAMILIES = (llama, gemma)  # each: unsupported(model) -> reason or None, and its forward class
_CLASSES = {llama: llama.LeanLlama, gemma: gemma.LeanGemma}
_BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (its lean forward or None, `_Watched`)
_HOOKED: weakref.WeakSet = weakref.WeakSet()  # models whose load_state_dict forgets their lean forward


def unsupported(model: nn.Module) -> str | None:
    """Why `model` takes the Hugging Face path, None when a lean forward runs it."""
    if not settings.current().lean:
        return f"{LEAN_ENV}=0"
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return "not a decoder-only transformers model"
    reasons = [family.unsupported(model) for family in _FAMILIES]
    if None not in reasons:
        return "; ".join(reasons)
    if not hasattr(model, "model") or not hasattr(model, "lm_head"):
        return f"{type(model).__name__} has no decoder and head to run"
    if any(hasattr(module, "_hf_hook") for module in model.modules()):
        return "dispatched by accelerate (device_map): its hooks move the weights"
    return None


def _family(model: nn.Module):
    return next(family for family in _FAMILIES if family.unsupported(model) is None)


def lean_decoder(model: nn.Module):
    """`model`'s lean forward, built on first use (the fused weights replace the model's own by views: no
    second copy), None when `unsupported(model)` says why not. Built again where the model's weights were loaded
    since (`load_state_dict`, in place or assigned: a forward holds fused copies and data pointers) or a sampled
    parameter was replaced (`_Watched`)."""
    built = _BUILT.get(model)  # the answer for a model is kept, a "no" too (it is asked at every pass)
    if built is None or (built[0] is not None and not built[1].unchanged()):
        lean = _CLASSES[_family(model)](model) if unsupported(model) is None else None
        if lean is not None and model not in _HOOKED:
            model.register_load_state_dict_post_hook(_loaded_again)
            _HOOKED.add(model)
        built = _BUILT[model] = (lean, _Watched(model) if lean is not None else None)
    return built[0]


def forget(model: nn.Module) -> None:
    """Drop `model`'s lean forward (its linears were replaced: `utils.quantized_models.install`; its weights
    loaded again)."""
    _BUILT.pop(model, None)


def _loaded_again(model: nn.Module, incompatible_keys) -> None:
    """`load_state_dict`'s post hook: the next pass builds the lean forward over the weights now loaded."""
    forget(model)


class _Watched:
    """A few of a model's parameters, as its lean forward was built over them (the first, the last and two
    between, by name): whether each is still the same tensor at the same address, checked at every pass (a few
    attribute reads) so that a parameter replaced without `load_state_dict` (`module.weight = ...`, `.data = ...`)
    is seen."""

    SAMPLES = 4

    def __init__(self, model: nn.Module) -> None:
        names = [name for name, _ in model.named_parameters()]
        picked = sorted({names[round(i * (len(names) - 1) / (self.SAMPLES - 1))] for i in range(self.SAMPLES)}) if names else []
        self._watched = []
        for name in picked:
            owner, _, attribute = name.rpartition(".")
            module = model.get_submodule(owner)
            tensor = getattr(module, attribute)
            self._watched.append((weakref.ref(module), attribute, tensor, tensor.data_ptr()))  # the model not kept

    def unchanged(self) -> bool:
        return all(getattr(module(), attribute, None) is tensor and tensor.data_ptr() == address
                   for module, attribute, tensor, address in self._watched)


def forward_path(model: nn.Module) -> str:
    """Which forward `model`'s passes take, in one line."""
    reason = unsupported(model)
    if reason is not None:
        return f"Hugging Face forward ({reason})"
    lean, file = lean_decoder(model), _family(model).__name__.rpartition(".")[2]  # built here where not yet
    if lean.stack is not None and lean.stack.runs(1):
        return f"lean forward ({file}.py, its layers in one native call)"
    if lean.stack is not None:  # the stack could run it, but the kernel tables take torch's products here
        return (f"lean forward ({file}.py, layers in Python: the kernel tables measured torch's products faster "
                f"for some of its linears here; kernel_plan(model) says which)")
    return f"lean forward ({file}.py, layers in Python: {NativeStack.unsupported(lean)})"


def kernel_plan(model: nn.Module) -> str:
    """`forward_path(model)`, then what runs each step of a pass by its width (`plan.py`), as a small table: one
    place to read which kernel a pass of this model takes here."""
    lean = lean_decoder(model)
    if lean is None:
        return forward_path(model)
    dtype = str(lean.dtype).removeprefix("torch.")
    invariant = "width-invariant" if lean.invariant else "the fastest kernel per width"
    lines = [f"{forward_path(model)}: computes in {dtype}, {invariant}"]
    for width, steps in plan.plan(lean):
        lines.append(f"  {width} tokens:")
        lines += [f"    {step:<20} {implementation}" for step, implementation in steps.items()]
    return "\n".join(lines)
