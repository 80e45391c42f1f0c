"""The lean forward's layers in one native call (`utils/lean/decoder.py`, `decoder.c`): the Python layers' logits to
float32 rounding (the only step of its own, the MLP's activation, has its own e^x), over chains, a rollback, a tree
and a batch; each row the same bits whatever the pass's width; bfloat16 weights computed in float32 (an AVX2-only
CPU's path) and 4-bit ones (the self-drafter's); Llama, Qwen2, Qwen3's q/k norms, Phi-3 (a partial rotary step too)
and the Gemma family (gelu, norms times 1 + weight, Gemma 2 and 3's sliding layers and extra norms, Gemma 2's caps,
Gemma 3's two rotary tables). Where our kernels cannot be built, no lean forward takes the stack."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from sampling import quantized_drafter
from tests.conftest import require_native
from tests.models import VOCAB, gemma_config, phi3_rope, prompt
from utils.lean import forget, forward_path, layer_ops, lean_decoder, linear, native
from utils.lean.decoder import NativeStack
from utils.runners.static import StaticRunner

FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
            "qwen3": (Qwen3Config, Qwen3ForCausalLM), "phi3": (Phi3Config, Phi3ForCausalLM),
            "phi3-partial": (Phi3Config, Phi3ForCausalLM)}  # `llama.py`'s; "partial": 12 of each head's 16 turned
GEMMAS = ("gemma", "gemma2", "gemma3")  # `gemma.py`'s, from `gemma_config`


def _model(family: str, dtype: torch.dtype):
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.3, pad_token_id=0)
    if family in FAMILIES:
        config = FAMILIES[family][0](**common, **(phi3_rope(0.75) if family.endswith("partial") else {}))
        model_class = FAMILIES[family][1]
    else:
        config, model_class = gemma_config(family, common)
    config._attn_implementation = "eager" if family == "gemma2" else "sdpa"  # transformers runs Gemma 2 eager only
    model = model_class(config).eval()
    with torch.no_grad():  # random norms (Gemma's start at 0, a weight of 1 + 0), so that every weight is seen
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(0.0 if family.startswith("gemma") else 1.0, 0.3)
    return model.to(dtype)


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_our_activation_times_up_is_torchs_to_a_rounding(dtype, activation):
    require_native()
    torch.manual_seed(0)
    gate_up = (4 * torch.randn(5, 2 * 4864)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    ours, theirs = layer_ops.gated_mul(gate_up, activation), act * up
    # Within a float32 ulp or two of the inputs' scale |gate up|: gelu's 1 + tanh(y) cancels where tanh nears -1, in
    # torch's steps and ours alike, so there a small value can be far from torch's relatively, never absolutely.
    scale = (gate.float() * up.float()).abs()
    difference = (ours.float() - theirs.float()).abs()
    if dtype == torch.float32:
        assert (difference <= 4e-7 * scale).all()
        if activation == "silu":
            assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-7)
    else:  # at most one bfloat16 step from torch's, where the float32 value sits at a rounding's edge
        assert (difference <= theirs.float().abs() * 2**-7 + 4e-7 * scale).all()
        assert (ours == theirs).float().mean() > (0.999 if activation == "silu" else 0.95)


@pytest.fixture
def no_bfloat16_arithmetic(monkeypatch):
    """A CPU without bfloat16 arithmetic (AVX2 only): a bfloat16 model computes in float32 through our kernels."""
    monkeypatch.setattr(native, "bfloat16_arithmetic", lambda: False)


def _bfloat16_weights(family: str):
    return _model(family, torch.bfloat16)


def _four_bits(family: str):
    return quantized_drafter(_model(family, torch.float32))


def _four_bits_in_groups_of_64(family: str):
    return quantized_drafter(_model(family, torch.float32), group_size=64)


@pytest.mark.parametrize("family", [*FAMILIES, *GEMMAS])
@pytest.mark.parametrize("make", [_bfloat16_weights, _four_bits, _four_bits_in_groups_of_64],
                         ids=["bfloat16_weights", "four_bits", "four_bits_groups_of_64"])
def test_the_stack_gives_the_python_layers_logits_and_the_same_bits_at_every_width(family, make, no_bfloat16_arithmetic,
                                                                                   monkeypatch):
    require_native()
    model = make(family)
    forget(model)
    lean = lean_decoder(model)
    assert lean.dtype == torch.float32 and lean.stack is not None, NativeStack.unsupported(lean)
    file = "llama.py" if family in FAMILIES else "gemma.py"
    assert forward_path(model) == f"lean forward ({file}, its layers in one native call)"
    assert all(lean.stack.runs(tokens) for tokens in range(1, native.MAX_ROWS + 1))
    assert not lean.stack.runs(native.MAX_ROWS + 1)  # a wider prompt: the Python layers
    calls = []
    called = layer_ops.decoder
    monkeypatch.setattr(layer_ops, "decoder", lambda *arguments: calls.append(1) or called(*arguments))
    ids, new = prompt(1, 30), [5, 6, 7, 8, 9, 10, 11]

    def passes() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        runner = StaticRunner(model, rows=1, slots=128)
        chain = [runner.forward_rows([(ids[a:b], None)], [b - a])[0] for a, b in ((0, 11), (11, 12), (12, 20))]
        runner.rollback_row(0, 16)
        chain.append(runner.forward_rows([(ids[16:30], None)], [14])[0])
        wide = runner.forward_rows([(new, None)], [len(new)])[0]
        runner.rollback_row(0, 30)
        ones = torch.cat([runner.forward_rows([([token], None)], [1])[0] for token in new])
        runner.rollback_row(0, 30)
        tree = runner.forward_rows([([new[0], 12, 13, new[1], 14, new[2]], [-1, 0, 0, 0, 3, 3])], [6])[0]
        assert torch.equal(wide, ones) and torch.equal(tree[[0, 3, 5]], ones[:3])
        batch = StaticRunner(model, rows=2, slots=128)
        rows = batch.forward_rows([(ids[:9], None), (ids[:4], None)], [1, 1])
        rows += batch.forward_rows([(new[:3], None), (new, None)], [3, 7])
        return chain + [wide, tree] + rows

    stacked = passes()
    assert len(calls) == 15  # every pass: none is wider than native.MAX_ROWS tokens
    lean.stack = None
    python = passes()
    assert len(calls) == 15
    for ours, theirs in zip(stacked, python, strict=True):
        assert (ours - theirs).abs().max() < 1e-4


def _float32_model(family: str):
    torch.manual_seed(0)
    config_class, model_class = FAMILIES[family]
    config = config_class(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config._attn_implementation = "sdpa"
    return model_class(config).eval()


def test_a_model_the_stack_cannot_run_says_why_and_keeps_the_python_layers(monkeypatch):
    if native.unavailable() is not None:  # where ours cannot run: no stack, the Python layers
        assert lean_decoder(_model("llama", torch.bfloat16)).stack is None
        return
    float32 = lean_decoder(_float32_model("llama"))  # float32 weights: torch's products
    assert float32.stack is None and "a linear our kernels do not run" in NativeStack.unsupported(float32)
    model = _model("qwen2", torch.bfloat16)
    monkeypatch.setattr(native, "bfloat16_arithmetic", lambda: True)  # computed in bfloat16: the kernel table decides
    lean = lean_decoder(model)
    with monkeypatch.context() as patched:
        patched.setattr(linear, "kernel_table", lambda shape, dtype, device: lambda rows: ("linear", 0))
        assert lean.stack is not None and not lean.stack.runs(1)  # the kernel table takes torch's product
    forget(model)
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert lean_decoder(model).stack is None
    forget(model)


def test_the_shape_mirror_is_checked_against_the_compiled_layout(monkeypatch):
    """decoder.py's ctypes `Shape` and decoder.c's `specdec_shape_t` as compiled: the same size and offsets, and a
    layout that differs keeps every model off the stack with the reason."""
    from utils.lean import decoder

    require_native()
    assert decoder._shape_mismatch() is None
    assert layer_ops.shape_layout()[0] == ctypes.sizeof(decoder.Shape)
    monkeypatch.setattr(layer_ops, "shape_layout", lambda: [0])
    model = _model("llama", torch.bfloat16)
    forget(model)
    assert lean_decoder(model).stack is None and "is not decoder.c's specdec_shape_t" in forward_path(model)


def test_the_numbers_a_spec_is_told_in_are_checked_against_decoder_c(monkeypatch):
    """The layer kind bits, the activation kinds and a layer's pointer count: decoder.c's own (`specdec.h`), and a
    number that differs keeps every model off the stack with the reason."""
    require_native()
    assert layer_ops.spec_numbers() == [1, 2, 0, 1, 18]
    monkeypatch.setattr(layer_ops, "spec_numbers", lambda: [1, 2, 1, 0, 18])
    model = _model("gemma2", torch.bfloat16)
    forget(model)
    assert lean_decoder(model).stack is None and "are not decoder.c's [1, 2, 1, 0, 18]" in forward_path(model)


@pytest.mark.parametrize("name", ["llama", "qwen3", "phi3", "gemma", "gemma2", "gemma3"])
def test_each_family_states_its_layer_once(name):
    """`LayerSpec`: what the Python layers branch on and decoder.c reads, from the model's config and modules."""
    model = _model(name, torch.bfloat16)
    spec = lean_decoder(model).spec
    config = model.config
    assert spec.eps == config.rms_norm_eps and spec.norm_plus_one == name.startswith("gemma")
    assert spec.qk_norms == (name in ("qwen3", "gemma3")) and spec.sandwich_norms == (name in ("gemma2", "gemma3"))
    assert spec.softcap == getattr(config, "attn_logit_softcapping", None)
    layers = len(model.model.layers)
    kinds = [spec.kind_bits(index, layers) for index in range(layers)]
    if name in ("gemma2", "gemma3"):  # sliding and full layers; Gemma 3's take tables of their own by kind
        types = config.layer_types[:layers]
        second = [name == "gemma3" and kind != types[0] for kind in types]  # the table of the first layer's kind first
        assert kinds == [(kind == "sliding_attention") + 2 * other for kind, other in zip(types, second, strict=True)]
    else:
        assert kinds == [0] * layers and spec.rope_kinds(layers) == (None,)


def test_the_kernel_plan_says_what_runs_each_step_at_each_width(no_bfloat16_arithmetic):
    """`kernel_plan`: float32 over bfloat16 weights (our kernels alone) runs every layer in one native call up to 32
    tokens and in Python past it; a float64 model (the oracle) takes torch's operations everywhere."""
    from utils.lean import kernel_plan

    require_native()
    model = _model("llama", torch.bfloat16)
    forget(model)
    text = kernel_plan(model)
    assert text.startswith(forward_path(model)) and "computes in float32, width-invariant" in text
    widths = text.split(" tokens:")
    assert all("one native call" in part for part in widths[1:-1]) and "Python, a call a step" in widths[-1]
    assert "ours, float32 rows over bfloat16" in widths[1] and "torch's F.linear in float32" in widths[-1]
    oracle = _model("llama", torch.float64)
    plan = kernel_plan(oracle)
    assert "one native call" not in plan and "ours" not in plan.replace("torch's", "")
