"""Our own layer operations (`utils/lean/layer_ops.py`): RMSNorm (Llama's and Gemma's, with the residual addition), the
rotary step with the buffer's write, and attention over the static buffer. The norms' last step and the rotary step
give torch's eager bits; attention gives a float64 reference's values to float32 (bfloat16) rounding and the same
bits whatever the pass's width, the keys it reads past a row's length and the thread count. Through the lean
forward, in float32, every family's logits are the Hugging Face model's to float32 rounding."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tests.conftest import require_native
from tests.models import VOCAB, prompt
from utils.lean import forget, layer_ops, lean_decoder, native
from utils.lean.gemma import gemma_norm
from utils.lean.llama import rms_norm, rotate
from utils.runners.static import StaticRunner

DTYPES = [torch.float32, torch.bfloat16]


def _require_ours() -> None:
    """Our C operations run here; where they cannot, no lean forward takes them (`unavailable()` says why) and the
    test is skipped with that reason (failed under SPECDEC_REQUIRE_NATIVE=1), not passed silently."""
    if native.unavailable() is not None:
        assert not layer_ops.runs(torch.float32, 64, 16)
    require_native()


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_norms_give_torchs_bits(dtype):
    _require_ours()
    torch.manual_seed(0)
    x, delta, weight = torch.randn(3, 5, 96).to(dtype), torch.randn(3, 5, 96).to(dtype), torch.randn(96).to(dtype)
    # the normalisation's sum is taken in an order of its own: float32 rounding of it, then torch's last steps
    tolerance = 2e-6 if dtype == torch.float32 else 2e-2
    assert torch.allclose(layer_ops.rms_norm(x, weight, 1e-6).double(), rms_norm(x, weight, 1e-6).double(), atol=tolerance)
    gemma = layer_ops.rms_norm(x, weight, 1e-6, plus_one=True)
    assert torch.allclose(gemma.double(), gemma_norm(x, weight, 1e-6).double(), atol=tolerance)
    h, normed = layer_ops.add_rms_norm(x.clone(), delta, weight, 1e-6)
    assert torch.equal(h, x + delta) and torch.equal(normed, layer_ops.rms_norm(x + delta, weight, 1e-6))
    # a float32 pass over a bfloat16 model: the norm's weight stays bfloat16
    as_float = layer_ops.rms_norm(x.float(), weight.to(torch.bfloat16), 1e-6)
    assert torch.allclose(as_float, rms_norm(x.float(), weight.to(torch.bfloat16), 1e-6), atol=2e-6)


@pytest.mark.parametrize("turned", [64, 32, 48], ids=["whole_heads", "half_of_each", "three_quarters"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_rotary_step_gives_torchs_bits_and_writes_only_its_slots(dtype, turned):
    """Whole heads, and a partial rotary step (Phi-4-mini turns 96 of 128): tables `turned` wide turn each head's
    first dimensions (32 of 64 through rope.c's vector loop, 48 through its scalar one), the rest passed as they are."""
    _require_ours()
    torch.manual_seed(0)
    rows, width, heads, kv_heads, head_dim, slots = 2, 3, 6, 2, 64, 40
    qkv = torch.randn(rows, width, (heads + 2 * kv_heads) * head_dim).to(dtype)
    cos, sin = torch.randn(slots, turned).to(dtype), torch.randn(slots, turned).to(dtype)
    positions, write_index = torch.tensor([[3, 4, 5], [9, 7, 8]]), torch.tensor([[5, 6, 7], [10, 11, 12]])
    keys, values = torch.zeros(rows, kv_heads, slots, head_dim, dtype=dtype), torch.zeros(rows, kv_heads, slots, head_dim, dtype=dtype)
    q = layer_ops.rope_write(qkv, cos, sin, positions, write_index, keys, values, heads)
    q_ref, k_ref, v_ref = rotated_reference(qkv, cos, sin, positions, heads, kv_heads)
    assert torch.equal(q.transpose(1, 2), q_ref)
    for row in range(rows):
        written = write_index[row]
        assert torch.equal(keys[row][:, written], k_ref[row]) and torch.equal(values[row][:, written], v_ref[row])
    assert keys[:, :, :5].abs().sum() == 0 and values[:, :, 13:].abs().sum() == 0  # nothing else written


def rotated_reference(qkv, cos, sin, positions, heads: int, kv_heads: int) -> tuple[torch.Tensor, ...]:
    """The q/k/v product's output (rows, width, (heads + 2 kv_heads) head_dim) in torch's steps -> q and k rotated
    at `positions` (by `llama.rotate`: tables narrower than a head turn its first dimensions), and v, each (rows,
    heads of its kind, width, head_dim): what `layer_ops.rope_write` returns and writes."""
    rows, width = positions.shape
    head_dim = qkv.shape[-1] // (heads + 2 * kv_heads)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    c, s = cos[positions][:, None], sin[positions][:, None]
    q = rotate(q.reshape(rows, width, heads, head_dim).transpose(1, 2), c, s)
    k = rotate(k.reshape(rows, width, kv_heads, head_dim).transpose(1, 2), c, s)
    return q, k, v.reshape(rows, width, kv_heads, head_dim).transpose(1, 2)


def attention_reference(q, keys, values, mask, scale, softcap=None) -> torch.Tensor:
    """Attention in float64 over the keys the mask does not hide (at or below -1e30), (rows, width, heads * head_dim);
    a query that sees none: 0."""
    rows, heads, width, head_dim = q.shape
    used, group = mask.shape[-1], heads // keys.shape[1]
    k = keys[:, :, :used].double().repeat_interleave(group, 1)
    v = values[:, :, :used].double().repeat_interleave(group, 1)
    scores = q.double() @ k.transpose(2, 3) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    hidden = mask.double() <= -1e30
    scores = (scores + mask.double()).masked_fill(hidden, float("-inf"))
    weights = torch.nan_to_num(scores.softmax(-1), nan=0.0)
    return (weights @ v).transpose(1, 2).reshape(rows, width, heads * head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_attention_gives_the_reference_values_and_each_query_the_same_bits_at_every_width(dtype, softcap):
    """Two rows, grouped query heads, a mask hiding keys of row 0 past its length and one key of a query of row 1
    (a tree's sibling); then each query alone, over more slots than it sees, and on another thread count."""
    _require_ours()
    torch.manual_seed(0)
    rows, heads, kv_heads, head_dim, slots, used, width = 2, 6, 2, 32, 64, 37, 5
    q = torch.randn(rows, heads, width, head_dim).to(dtype)
    keys, values = torch.randn(rows, kv_heads, slots, head_dim).to(dtype), torch.randn(rows, kv_heads, slots, head_dim).to(dtype)
    hidden = torch.finfo(dtype).min
    mask = torch.zeros(rows, 1, width, used, dtype=dtype)
    mask[0, :, :, 30:] = hidden
    mask[1, :, 2, 33] = hidden
    scale = head_dim**-0.5
    out = layer_ops.attention(q, keys, values, mask, scale, softcap)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16: the output rounded once
    assert out.dtype == dtype and torch.allclose(out.double(), attention_reference(q, keys, values, mask, scale, softcap), atol=tolerance)
    more = torch.cat([mask, torch.full((rows, 1, width, 20), hidden, dtype=dtype)], dim=-1)  # slots past `used`
    threads = torch.get_num_threads()
    for t in range(width):
        one = layer_ops.attention(q[:, :, t : t + 1], keys, values, mask[:, :, t : t + 1], scale, softcap)
        assert torch.equal(one, out[:, t : t + 1])
        assert torch.equal(layer_ops.attention(q[:, :, t : t + 1], keys, values, more[:, :, t : t + 1], scale, softcap), one)
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.equal(layer_ops.attention(q, keys, values, mask, scale, softcap), out)
    finally:
        torch.set_num_threads(threads)
    # a query that sees no key gets zeros, not NaN
    blind = torch.full((rows, 1, 1, used), hidden, dtype=dtype)
    assert layer_ops.attention(q[:, :, :1], keys, values, blind, scale, softcap).abs().sum() == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, width", [(4, 1, 1), (9, 3, 1), (4, 1, 3)])
def test_threads_that_share_a_querys_keys_give_its_bits_on_one_thread(dtype, heads, kv_heads, width):
    """One query over a long buffer and fewer key heads than threads (Gemma 3's one key head; three on two threads):
    the threads share each query's keys, values and heads (attention.c's attention_spread), and every output is the
    bits one thread gives, within the float64 reference's tolerance."""
    _require_ours()
    torch.manual_seed(0)
    head_dim, used = 64, 2200  # past 512 keys a thread on two to four threads
    q = torch.randn(1, heads, width, head_dim).to(dtype)
    keys, values = torch.randn(1, kv_heads, used + 8, head_dim).to(dtype), torch.randn(1, kv_heads, used + 8, head_dim).to(dtype)
    mask = torch.zeros(1, 1, width, used, dtype=dtype)
    mask[0, :, -1, 1000:1500] = torch.finfo(dtype).min  # a tree's hidden branch
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = layer_ops.attention(q, keys, values, mask, head_dim**-0.5, None)
        for team in (2, 3, 4):
            torch.set_num_threads(team)
            assert torch.equal(layer_ops.attention(q, keys, values, mask, head_dim**-0.5, None), alone), team
    finally:
        torch.set_num_threads(threads)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(alone.double(), attention_reference(q, keys, values, mask, head_dim**-0.5), atol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tree_nodes_attention_is_the_bits_it_gets_once_moved_next_to_its_ancestors(dtype):
    """A tree's node sees its context, its ancestors and itself, with hidden siblings between them; once accepted its
    keys move next to each other (`keep_path_row`) and a later pass reads them there: the same keys in the same order,
    so the same bits (the softmax's sum is laid out by the keys a query sees, not by their slots)."""
    _require_ours()
    torch.manual_seed(1)
    heads, kv_heads, head_dim, context = 4, 2, 32, 45
    keys, values = torch.randn(1, kv_heads, 64, head_dim).to(dtype), torch.randn(1, kv_heads, 64, head_dim).to(dtype)
    q = torch.randn(1, heads, 1, head_dim).to(dtype)
    hidden = torch.finfo(dtype).min
    for seen_slots in ([45, 49, 52], [46, 47, 55], [50]):  # ancestors and the node itself, after hidden siblings
        tree_mask = torch.full((1, 1, 1, 64), hidden, dtype=dtype)
        tree_mask[..., :context] = 0
        tree_mask[..., seen_slots] = 0
        moved = list(range(context, context + len(seen_slots)))
        moved_keys, moved_values = keys.clone(), values.clone()
        moved_keys[:, :, moved], moved_values[:, :, moved] = keys[:, :, seen_slots], values[:, :, seen_slots]
        chain_mask = torch.full((1, 1, 1, 64), hidden, dtype=dtype)
        chain_mask[..., : context + len(seen_slots)] = 0
        tree = layer_ops.attention(q, keys, values, tree_mask, head_dim**-0.5, None)
        assert torch.equal(tree, layer_ops.attention(q, moved_keys, moved_values, chain_mask, head_dim**-0.5, None)), seen_slots


def _model(family: str):
    """A float32 model of `family` with heads of 16 (the size our operations need), two layers, grouped heads."""
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.3)
    configs = {
        "llama": (LlamaConfig(**common), LlamaForCausalLM),
        "qwen2": (Qwen2Config(**common), Qwen2ForCausalLM),
        "qwen3": (Qwen3Config(**common), Qwen3ForCausalLM),
        "gemma2": (Gemma2Config(**common, attn_logit_softcapping=5.0, final_logit_softcapping=3.0, sliding_window=6,
                                query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"]),
                   Gemma2ForCausalLM),
        "gemma3": (Gemma3TextConfig(**common, sliding_window=6, query_pre_attn_scalar=24,
                                    layer_types=["sliding_attention", "full_attention"]), Gemma3ForCausalLM),
    }
    config, model_class = configs[family]
    config._attn_implementation = "eager" if family == "gemma2" else "sdpa"
    model = model_class(config).float().eval()
    if family.startswith("gemma"):
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "norm" in name:
                    parameter.normal_(0.0, 0.3)
    return model


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma2", "gemma3"])
def test_the_lean_forward_over_our_operations_gives_the_models_float32_logits(family, monkeypatch):
    """Chains, a rollback and a tree through our operations (Qwen3 and Gemma 3: their q/k norms, then our rotary
    step; Gemma 2: capped scores; sliding layers past their window): the Hugging Face model's float32 logits to
    float32 rounding.
    With SPECDEC_NATIVE=0 the same model takes torch's operations."""
    model = _model(family)
    lean = lean_decoder(model)
    runs = native.unavailable() is None  # both ways: torch's operations where ours cannot run
    assert lean.native == runs
    ids = prompt(1, 30)
    with torch.no_grad():
        reference = model(input_ids=torch.tensor([ids])).logits[0]
    runner = StaticRunner(model, rows=1, slots=128)
    pieces = [runner.forward_rows([(ids[a:b], None)], [b - a])[0] for a, b in ((0, 11), (11, 12), (12, 20))]
    runner.rollback_row(0, 16)
    pieces[-1] = pieces[-1][:4]
    pieces.append(runner.forward_rows([(ids[16:30], None)], [14])[0])
    assert (torch.cat(pieces) - reference).abs().max() < 1e-4
    runner.rollback_row(0, 20)
    tree = runner.forward_rows([([5, 6, 7, 8], [-1, 0, 0, 2])], [4])[0]  # 5 -> (6, 7 -> 8)
    with torch.no_grad():
        path = model(input_ids=torch.tensor([ids[:20] + [5, 7, 8]])).logits[0, -1]
    assert (tree[3] - path).abs().max() < 1e-4
    forget(model)
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert native.unavailable() == f"{native.NATIVE_ENV}=0" and not lean_decoder(model).native
    forget(model)
