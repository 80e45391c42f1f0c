"""A family's decoder layer stated once (`LayerSpec`): what our Python layers branch on (`llama.py`, `gemma.py`) and
what decoder.c reads (`decoder.py` packs it into `specdec_shape_t`, whose layout it checks against the compiled one,
and into each layer's kind bits). A family's file builds its spec from the model (`LeanLlama.spec_of`); nothing
else asks the config how the family computes.

    spec = LeanLlama.spec_of(model)   the Llama family's; LeanGemma.spec_of: Gemma's
    spec.sliding(i), spec.rope(i)     layer i attends through the sliding-window mask; takes that rotary table
    spec.kind_bits(i)                 decoder.c's bits for layer i (SLIDING, SECOND_ROPE)
"""

from __future__ import annotations

from dataclasses import dataclass

SLIDING, SECOND_ROPE = 1, 2  # decoder.c's layer kind bits
LAYER_TYPES = ("sliding_attention", "full_attention")  # transformers' names of a layer's kind


@dataclass(frozen=True)
class LayerSpec:
    """How every decoder layer of a model computes (besides its tensors' shapes, which the tensors say).

    `eps`: the RMSNorms'; `scaling`: the attention scores' factor; `activation`: the MLP's, by transformers' name
    (`hidden_act`); `norm_plus_one`: RMSNorm's weight applied as (1 + weight), in float32 (Gemma's);
    `qk_norms`: each head's q and k normalised before the rotary step (Qwen3, Gemma 3); `sandwich_norms`: norms
    after the attention and after the MLP too (Gemma 2 and 3); `softcap`: the attention logits capped by a tanh
    (Gemma 2); `final_softcap`: the logits' cap; `embed_scale`: the embeddings multiplied by it in the model's
    dtype (Gemma under transformers 4.x; None where the embedding module scales them itself or nothing does);
    `layer_types`: each layer's kind (`LAYER_TYPES`; empty: every layer attends through the runner's one mask);
    `rope_by_type`: each kind of layer takes a rotary table of its own (Gemma 3)."""

    eps: float
    scaling: float
    activation: str
    norm_plus_one: bool = False
    qk_norms: bool = False
    sandwich_norms: bool = False
    softcap: float | None = None
    final_softcap: float | None = None
    embed_scale: float | None = None
    layer_types: tuple[str, ...] = ()
    rope_by_type: bool = False

    def sliding(self, index: int) -> bool:
        """Whether layer `index` attends through the sliding-window mask (`PassSlots.sliding_mask`)."""
        return bool(self.layer_types) and self.layer_types[index] == "sliding_attention"

    def rope(self, index: int) -> str | None:
        """The rotary table layer `index` takes: its kind where kinds have tables of their own, else None (the one)."""
        return self.layer_types[index] if self.rope_by_type else None

    def rope_kinds(self, layers: int) -> tuple[str | None, ...]:
        """The rotary tables `layers` layers take, each once, in the order of their first layer."""
        return tuple(dict.fromkeys(self.rope(index) for index in range(layers)))

    def kind_bits(self, index: int, layers: int) -> int:
        """decoder.c's kind bits of layer `index` of `layers`: SLIDING, and SECOND_ROPE where it takes the second
        of `rope_kinds`."""
        second = self.rope(index) is not None and self.rope_kinds(layers).index(self.rope(index)) == 1
        return SLIDING * self.sliding(index) + SECOND_ROPE * second
