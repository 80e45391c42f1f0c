"""What the runners (and the input checks) read from a model: its kind, sizes and devices.

Nothing here depends on the transformers release (`compat.py` holds those differences) and
nothing is keyed on a model class: every answer comes from the config or the modules.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

__all__ = ["context_length", "input_device", "is_encoder_decoder", "mixes_windows", "model_devices", "pass_bytes",
           "shares_passes", "sliding_window", "vocab_size", "weight_pieces"]


def is_encoder_decoder(model: PreTrainedModel) -> bool:
    return bool(getattr(model.config, "is_encoder_decoder", False))


def decoder_config(model: PreTrainedModel):
    """The config of the (decoder of the) model: multimodal configs hold it apart."""
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def context_length(model: PreTrainedModel) -> int | None:
    """The largest number of positions the (decoder of the) model accepts, None if unbounded."""
    config = decoder_config(model)
    for name in ("max_position_embeddings", "n_positions", "max_target_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None  # relative position schemes (T5) have no hard limit


def vocab_size(model: PreTrainedModel) -> int:
    """Width of the model's logits (may exceed the tokenizer's size: padded embeddings)."""
    embeddings = model.get_output_embeddings()
    if embeddings is not None and hasattr(embeddings, "weight"):
        return int(embeddings.weight.shape[0])
    return int(decoder_config(model).vocab_size)


def input_device(model: PreTrainedModel) -> torch.device:
    """Where the model's input ids must go: the device its input embeddings run on.

    Not `model.device`: a model dispatched by accelerate (`device_map`) may be split over devices
    or offloaded to disk, where `model.device` is the first parameter's device (`meta` when
    offloaded). Accelerate's hook on the embeddings knows the execution device; without a hook the
    embedding weights' device is the answer.
    """
    embeddings = model.get_input_embeddings()
    hook_device = getattr(getattr(embeddings, "_hf_hook", None), "execution_device", None)
    if hook_device is not None:
        return torch.device(f"cuda:{hook_device}" if isinstance(hook_device, int) else hook_device)
    device = embeddings.weight.device
    return torch.device("cpu") if device.type == "meta" else device


def model_devices(model: torch.nn.Module) -> tuple[torch.device, ...]:
    """The devices that hold the model's parameters (several with a `device_map`; `meta`, an
    offloaded weight, is left out: accelerate runs it on another)."""
    devices = {parameter.device for parameter in model.parameters()}
    return tuple(sorted((d for d in devices if d.type != "meta"), key=str))


def shares_passes(model: PreTrainedModel, use_cache: bool) -> bool:
    """Whether the model takes a custom 4D mask with per-row positions exactly: decoder-only, with
    a cache, eager or SDPA attention, layers that share one mask (no mix of sliding and full).
    Such a model verifies token trees and shares one cache between the rows of a batch."""
    config = decoder_config(model)
    return (use_cache and not is_encoder_decoder(model) and not mixes_windows(model)
            and getattr(config, "_attn_implementation", None) in ("eager", "sdpa"))


def mixes_windows(model: PreTrainedModel) -> bool:
    """Whether the model's layers are of several kinds (Gemma 2 and 3: sliding-window and full attention), each
    kind attending through its own mask."""
    return len(set(getattr(decoder_config(model), "layer_types", None) or [])) > 1


def sliding_window(model: PreTrainedModel) -> int | None:
    """The attention window of a sliding-window model (Mistral style; a model that mixes layer kinds: its sliding
    layers'), None for full attention (a model whose layers are all of the full kind, a window set or not)."""
    config = decoder_config(model)
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types and "sliding_attention" not in layer_types:
        return None
    return int(window)


def weight_pieces(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weights one token's pass reads, in the model's order: every parameter and buffer (a quantized linear's
    packed weights and scales) but the input embedding's rows of other tokens (a tied embedding counts once: the head
    reads it whole); views that follow one another in memory (the lean forward's fused q/k/v and gate/up) as one
    flat byte tensor, as the pass reads them."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    head_weight = getattr(head, "weight", None)
    tied = head_weight is not None and head_weight.data_ptr() == embedding.weight.data_ptr()
    seen, spans, ends = set() if tied else {embedding.weight.data_ptr()}, [], {}  # spans: [storage, first, end]
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        storage = tensor.untyped_storage()
        first = tensor.data_ptr() - storage.data_ptr()
        end = first + tensor.numel() * tensor.element_size()
        span = ends.pop((storage.data_ptr(), first), None)  # a span this tensor continues (q, then its bias, then k)
        if span is None:
            span = [storage, first, end]
            spans.append(span)
        span[2] = end
        ends[(storage.data_ptr(), end)] = span
    return [torch.empty(0, dtype=torch.uint8).set_(storage, first, (end - first,)) for storage, first, end in spans]


def pass_bytes(model: torch.nn.Module) -> int | None:
    """Bytes of the weights one token's pass reads (`weight_pieces`); None where they cannot be read (weights on the
    meta device, offloaded; a model without an input embedding)."""
    try:
        if any(tensor.is_meta for tensor in (*model.parameters(), *model.buffers())):
            return None
        return sum(piece.numel() for piece in weight_pieces(model)) or None
    except (AttributeError, RuntimeError, NotImplementedError):
        return None
