"""The boundary between Python and our C kernels (`utils/lean/native.py`): every entry point checks what it hands to C.
A random call (fixed seed; widths 1-64, 1-40 rows so that some pass `MAX_ROWS`, float32, bfloat16, float16 and
float64, strided and offset views, slots in and out of range) either gives torch's reference (to the bit where the
function's docstring promises bits, else to a stated tolerance) or raises a ValueError/TypeError, never a wrong
reading. Then one test per fault found on tiny models: a float32 head over a bfloat16 model, float16 activations, a
column-major weight, a slot out of range (also under `python -O`, where the runner's assert is gone), and weights
loaded again after a first generation: each ends with the right tokens or a clear one-line refusal."""

from __future__ import annotations

import copy
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from tests.conftest import USER_CACHE
from tests.models import VOCAB, prompt
from tests.test_layer_ops import attention_reference, rotated_reference
from utils.lean import forget, layer_ops, lean_decoder, native
from utils.lean.boundary import READABLE
from utils.lean.gemma import gemma_norm
from utils.lean.llama import rms_norm
from utils.lean.static_kv import PassSlots, StaticKV
from utils.runners.static import StaticRunner

pytestmark = pytest.mark.usefixtures("requires_native")  # skipped with the reason; failed under SPECDEC_REQUIRE_NATIVE=1

SEED = 20261206
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
REFUSED = (ValueError, TypeError)
FAST_CALLS = 150  # per entry point, every run
SLOW_CALLS = 10_000  # per entry point, the `slow` run


def _pick_dtype(rng: random.Random) -> torch.dtype:
    return rng.choices(DTYPES, weights=[4, 4, 1, 1])[0]


def _laid_out(tensor: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """`tensor`'s values, contiguous, at a storage offset, or strided (a slice of a wider tensor, a transposed copy)."""
    kind = rng.randrange(4)
    if kind == 1:  # at an offset into a bigger storage
        flat = torch.empty(tensor.numel() + 7, dtype=tensor.dtype)
        flat[7:] = tensor.reshape(-1)
        return flat[7:].view(tensor.shape)
    if kind == 2 and tensor.dim() >= 1:  # every other element of a wider tensor's last dimension
        wide = torch.empty(*tensor.shape[:-1], 2 * tensor.shape[-1], dtype=tensor.dtype)
        wide[..., ::2] = tensor
        return wide[..., ::2]
    if kind == 3 and tensor.dim() >= 2:  # column-major
        return tensor.transpose(-1, -2).contiguous().transpose(-1, -2)
    return tensor


def _randn(*shape: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(dtype)


# ---- one random call of each entry point: True where it ran (and was checked), False where it refused ----


def _gemm_case(rng: random.Random, g: torch.Generator) -> bool:
    block = native.library().specdec_block()
    rows = rng.randint(0, 40)
    in_features = rng.choice([block, 2 * block, rng.randint(1, 64)])
    out_features = rng.randint(1, 64)
    x_dtype, w_dtype = _pick_dtype(rng), rng.choices([torch.bfloat16, torch.float32], weights=[9, 1])[0]
    x = _laid_out(_randn(rows, in_features, dtype=x_dtype, generator=g), rng)
    weight = _laid_out(_randn(out_features, in_features, dtype=w_dtype, generator=g), rng)
    bias_length = rng.choice([None, out_features, out_features, rng.randint(1, 64)])
    bias = None if bias_length is None else _randn(bias_length, dtype=rng.choice(DTYPES), generator=g)
    valid = (w_dtype == torch.bfloat16 and 1 <= rows <= native.MAX_ROWS and in_features % block == 0
             and bias_length in (None, out_features))
    try:
        y = native.gemm(x, weight, bias)
    except REFUSED:
        assert not valid
        return False
    assert valid and y.dtype == x_dtype and y.shape == (rows, out_features)
    used_bias = None if bias is None else bias.to(x_dtype if x_dtype in READABLE else torch.float32)
    exact = x.double() @ weight.double().T + (0 if used_bias is None else used_bias.double())
    scale = x.double().abs() @ weight.double().abs().T + (0 if bias is None else bias.double().abs()) + 1e-30
    tolerance = {torch.float32: 1e-5, torch.float64: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-9}[x_dtype]
    assert ((y.double() - exact).abs() <= tolerance * scale).all()
    assert torch.equal(native.gemm(x[:1], weight, bias), y[:1])  # a row's bits whatever the rows beside it
    return True


def _q4_weight(rng: random.Random, g: torch.Generator, out_features: int, in_features: int, group: int):
    q = torch.randint(0, 16, (out_features, in_features), generator=g)
    scales = torch.rand(out_features, in_features // group, generator=g) * 0.1 + 0.01
    minimums = -torch.rand(out_features, in_features // group, generator=g)
    return q, scales, minimums


def _dequantized(q: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor) -> torch.Tensor:
    """The weight d q + m in float32 from the float16 scales and minimums the layout keeps (a product, then a sum)."""
    group = q.shape[1] // scales.shape[1]
    d = scales.half().float().repeat_interleave(group, dim=1)
    m = minimums.half().float().repeat_interleave(group, dim=1)
    return d * q.float() + m


def _pack_q4_case(rng: random.Random, g: torch.Generator) -> bool:
    out_features, group = rng.randint(1, 40), rng.choice(native.Q4_GROUPS)
    in_features = rng.choice([group, 2 * group, rng.randint(1, 64)])
    scale_columns = in_features // group if rng.random() < 0.85 else rng.randint(0, 3)
    q, _, _ = _q4_weight(rng, g, out_features, max(in_features, 1) // 1, 1)
    q = q[:, :in_features].to(rng.choice([torch.uint8, torch.int64, torch.float32]))
    if rng.random() < 0.1 and q.numel():
        q[rng.randrange(q.shape[0]), rng.randrange(q.shape[1])] = rng.choice([16, -1]) if q.dtype != torch.uint8 else 16
    scales = torch.rand(out_features, scale_columns, generator=g) * 0.1 + 0.01
    minimums = -torch.rand(out_features, scale_columns, generator=g)
    valid = (in_features % native.Q4_BLOCK == 0 and scale_columns > 0 and in_features % scale_columns == 0
             and in_features // scale_columns in native.Q4_GROUPS and int(q.min()) >= 0 and int(q.max()) <= 15)
    try:
        packed, scales_minimums = native.pack_q4(q, scales, minimums)
    except REFUSED:
        assert not valid
        return False
    assert valid
    expected = _dequantized(q, scales, minimums)
    assert torch.equal(native.dequantize_q4(packed, scales_minimums, out_features), expected)
    return True


def _dequantize_q4_case(rng: random.Random, g: torch.Generator) -> bool:
    out_features, group = rng.randint(1, 40), rng.choice(native.Q4_GROUPS)
    in_features = group * rng.randint(1, 2)
    q, scales, minimums = _q4_weight(rng, g, out_features, in_features, group)
    packed, scales_minimums = native.pack_q4(q, scales, minimums)
    asked = rng.choice([out_features, out_features, rng.randint(-1, 64)])
    dtype = rng.choice(DTYPES)
    if rng.random() < 0.1:
        packed = _laid_out(packed, rng)
    valid = 0 < asked <= packed.shape[0] * native.Q4_ROWS and dtype in READABLE and packed.is_contiguous()
    try:
        weight = native.dequantize_q4(packed, scales_minimums, asked, dtype)
    except REFUSED:
        assert not valid
        return False
    assert valid
    padded = torch.cat([_dequantized(q, scales, minimums), torch.zeros(asked, in_features)])[:asked]
    padded[out_features:] = 0  # the layout's padding rows: zero weights, zero scales
    assert torch.equal(weight[:out_features], padded[:out_features].to(dtype))
    return True


def _gemm_q4_case(rng: random.Random, g: torch.Generator) -> bool:
    out_features, group = rng.randint(1, 40), rng.choice(native.Q4_GROUPS)
    in_features = group * rng.randint(1, 2)
    q, scales, minimums = _q4_weight(rng, g, out_features, in_features, group)
    packed, scales_minimums = native.pack_q4(q, scales, minimums)
    rows, x_width = rng.randint(0, 40), rng.choice([in_features, in_features, rng.randint(1, 64)])
    x_dtype = _pick_dtype(rng)
    x = _laid_out(_randn(rows, x_width, dtype=x_dtype, generator=g), rng)
    bias_length = rng.choice([None, out_features, rng.randint(1, 64)])
    bias = None if bias_length is None else _randn(bias_length, dtype=torch.float32, generator=g)
    valid = x_width == in_features and bias_length in (None, out_features)
    try:
        y = native.gemm_q4(x, packed, scales_minimums, out_features, bias)
    except REFUSED:
        assert not valid
        return False
    assert valid and y.dtype == x_dtype and y.shape == (rows, out_features)
    w = _dequantized(q, scales, minimums).double()
    exact = x.double() @ w.T + (0 if bias is None else bias.double())
    scale = x.double().abs() @ w.abs().T + 1e-30
    # activations quantized to int8 per block of 32 (a relative error of 1/254 a block), the result rounded once
    assert ((y.double() - exact).abs() <= 2e-2 * scale + 1e-2 * exact.abs()).all()
    return True


def _norm_case(rng: random.Random, g: torch.Generator) -> bool:
    tokens, n = rng.randint(0, 40), rng.choice([16, 32, 64, rng.randint(1, 64)])
    dtype, weight_dtype = _pick_dtype(rng), rng.choice([_pick_dtype(rng), torch.bfloat16])
    x = _laid_out(_randn(1, tokens, n, dtype=dtype, generator=g), rng)
    weight_length = n if rng.random() < 0.9 else rng.randint(1, 64)
    weight = _laid_out(_randn(weight_length, dtype=weight_dtype, generator=g), rng)
    plus_one, residual = rng.random() < 0.5, rng.random() < 0.5
    delta = _randn(1, tokens, n if rng.random() < 0.9 else rng.randint(1, 64), dtype=dtype, generator=g)
    valid = (n % layer_ops.LANES == 0 and dtype in READABLE and weight_dtype in READABLE
             and weight_length == n and (not residual or delta.shape == x.shape))
    before = x.clone()
    try:
        if residual:
            h, out = layer_ops.add_rms_norm(x, delta, weight, 1e-6, plus_one=plus_one)
        else:
            h, out = before, layer_ops.rms_norm(x, weight, 1e-6, plus_one=plus_one)
    except REFUSED:
        assert not valid and torch.equal(x, before)
        return False
    assert valid
    if residual:  # the residual addition: torch's bits, written into h
        assert torch.equal(h, before + delta)
    reference = (gemma_norm if plus_one else rms_norm)(h, weight.to(h.dtype) if not plus_one else weight, 1e-6)
    if not plus_one and weight_dtype != dtype:  # the weight applied in its own dtype's values, then x's
        reference = (weight.float() * rms_norm(h, torch.ones(n, dtype=dtype), 1e-6).float()).to(dtype)
    # the sum of squares in an order of its own: float32 rounding of it, then torch's last steps (one dtype step)
    tolerance = 2e-6 if dtype == torch.float32 else 2**-7
    assert torch.allclose(out.double(), reference.double(), rtol=tolerance, atol=tolerance * 4)
    return True


def _rope_case(rng: random.Random, g: torch.Generator) -> bool:
    rows, width = rng.randint(1, 4), rng.randint(1, 10)
    kv_heads = rng.randint(1, 3)
    heads = kv_heads * rng.randint(1, 3)
    head_dim, slots = rng.choice([16, 32, rng.randint(1, 64)]), rng.randint(1, 40)
    dtype = _pick_dtype(rng)
    qkv_width = (heads + 2 * kv_heads) * head_dim if rng.random() < 0.95 else rng.randint(1, 64)
    qkv = _laid_out(_randn(rows, width, qkv_width, dtype=dtype, generator=g), rng)
    table = rng.randint(1, 40)
    turned = head_dim if rng.random() < 0.7 else rng.randint(0, head_dim + 2)  # a partial rotary step, or a bad width
    cos, sin = _randn(table, turned, dtype=dtype, generator=g), _randn(table, turned, dtype=dtype, generator=g)
    positions = torch.randint(0, table, (rows, width), generator=g)
    write_index = torch.stack([torch.randperm(max(slots, width), generator=g)[:width] for _ in range(rows)])
    if rng.random() < 0.2:  # a slot or a position out of range
        tensor, end = (write_index, slots) if rng.random() < 0.5 else (positions, table)
        tensor[rng.randrange(rows), rng.randrange(width)] = rng.choice([end, end + 5, -1])
    buffer_dtype = dtype if rng.random() < 0.95 else rng.choice(DTYPES)
    keys = _randn(rows, kv_heads, slots, head_dim, dtype=buffer_dtype, generator=g)
    values = _randn(rows, kv_heads, slots, head_dim, dtype=buffer_dtype, generator=g)
    if rng.random() < 0.05:
        keys = _laid_out(keys, rng)
    keys_before, values_before = keys.clone(), values.clone()
    valid = (dtype in READABLE and buffer_dtype == dtype and head_dim % 2 == 0 and turned % 2 == 0
             and 2 <= turned <= head_dim and qkv_width == (heads + 2 * kv_heads) * head_dim and keys.is_contiguous()
             and int(write_index.min()) >= 0 and int(write_index.max()) < slots
             and int(positions.min()) >= 0 and int(positions.max()) < table)
    try:
        q = layer_ops.rope_write(qkv, cos, sin, positions, write_index, keys, values, heads)
    except REFUSED:
        assert not valid and torch.equal(keys, keys_before) and torch.equal(values, values_before)  # nothing written
        return False
    assert valid
    q_ref, k_ref, v_ref = rotated_reference(qkv, cos, sin, positions, heads, kv_heads)
    assert torch.equal(q.transpose(1, 2), q_ref)
    for row in range(rows):
        written = write_index[row]
        assert torch.equal(keys[row][:, written], k_ref[row]) and torch.equal(values[row][:, written], v_ref[row])
        untouched = torch.ones(slots, dtype=torch.bool)
        untouched[written] = False
        assert torch.equal(keys[row][:, untouched], keys_before[row][:, untouched])
        assert torch.equal(values[row][:, untouched], values_before[row][:, untouched])
    return True


def _attention_case(rng: random.Random, g: torch.Generator) -> bool:
    rows, width = rng.randint(1, 3), rng.randint(1, 8)
    kv_heads = rng.randint(1, 2)
    heads = kv_heads * rng.randint(1, 3) + (1 if rng.random() < 0.05 else 0)
    head_dim, slots = rng.choice([16, 32, 16 * rng.randint(1, 4), rng.randint(1, 64)]), rng.randint(1, 40)
    used = rng.randint(1, slots) if rng.random() < 0.95 else slots + rng.randint(1, 5)
    dtype = _pick_dtype(rng)
    q = _randn(rows, width, heads, head_dim, dtype=dtype, generator=g).transpose(1, 2)  # the lean forward's strides
    q = _laid_out(q, rng) if rng.random() < 0.3 else q
    keys = _randn(rows, kv_heads, slots, head_dim, dtype=dtype, generator=g)
    values = _randn(rows, kv_heads, slots, head_dim, dtype=dtype, generator=g)
    mask_dtype = dtype if dtype in READABLE else torch.float32
    hide = torch.rand(rows, 1, width, used, generator=g) < 0.3
    hide[..., 0] = rng.random() < 0.05  # now and then a query that sees no key
    mask = torch.zeros(rows, 1, width, used, dtype=mask_dtype).masked_fill(hide, torch.finfo(mask_dtype).min)
    mask = _laid_out(mask, rng)
    softcap = rng.choice([None, 5.0])
    valid = (dtype in READABLE and head_dim % layer_ops.LANES == 0 and heads % kv_heads == 0 and used <= slots)
    try:
        out = layer_ops.attention(q, keys, values, mask, head_dim**-0.5, softcap)
    except REFUSED:
        assert not valid
        return False
    assert valid
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    reference = attention_reference(q, keys, values, mask, head_dim**-0.5, softcap)
    assert torch.allclose(out.double(), reference, atol=tolerance, rtol=tolerance)
    return True


def _gated_case(rng: random.Random, g: torch.Generator) -> bool:
    tokens, n = rng.randint(0, 40), rng.choice([16, 32, rng.randint(1, 64)])
    dtype = _pick_dtype(rng)
    gate_up = _laid_out(4 * _randn(tokens, 2 * n if rng.random() < 0.9 else rng.randint(1, 64), dtype=dtype, generator=g), rng)
    activation = rng.choice(["silu", "gelu_pytorch_tanh", "silu", "relu"])
    width = gate_up.shape[-1]
    valid = dtype in READABLE and width > 0 and width % (2 * layer_ops.LANES) == 0 and activation != "relu"
    try:
        out = layer_ops.gated_mul(gate_up, activation)
    except REFUSED:
        assert not valid
        return False
    assert valid
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    theirs, scale = act * up, (gate.float() * up.float()).abs()
    difference = (out.float() - theirs.float()).abs()
    if dtype == torch.float32:  # within a float32 ulp or a few of torch's (test_native_stack.py)
        assert (difference <= 4e-7 * scale + 1e-30).all()
    else:  # at most one bfloat16 step from torch's
        assert (difference <= theirs.float().abs() * 2**-7 + 4e-7 * scale + 1e-30).all()
    return True


CASES = {"gemm": _gemm_case, "gemm_q4": _gemm_q4_case, "dequantize_q4": _dequantize_q4_case, "pack_q4": _pack_q4_case,
         "rms_norm_and_add_rms_norm": _norm_case, "rope_write": _rope_case, "attention": _attention_case,
         "gated_mul": _gated_case}


def _fuzz(name: str, calls: int) -> None:
    rng, g = random.Random(f"{SEED}-{name}"), torch.Generator().manual_seed(SEED)
    ran = sum(CASES[name](rng, g) for _ in range(calls))
    assert 0.2 * calls < ran < calls  # both sides of the boundary were reached


@pytest.mark.parametrize("name", CASES)
def test_random_calls_equal_torchs_reference_or_raise_a_clean_error(name):
    _fuzz(name, FAST_CALLS)


@pytest.mark.portable
@pytest.mark.parametrize("name", CASES)
def test_ten_thousand_random_calls_equal_torchs_reference_or_raise_a_clean_error(name):
    _fuzz(name, SLOW_CALLS)


# ---- the faults found on tiny models ----


def _llama(dtype: torch.dtype, seed: int = 0) -> LlamaForCausalLM:
    """A tiny Llama our layer operations run (heads of 16, widths multiples of 16), in `dtype`."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         initializer_range=0.3)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval().to(dtype)


def _greedy(model, ids: list[int], new: int) -> tuple[list[int], torch.Tensor]:
    """`new` greedy tokens after `ids` through the static runner (the lean forward), and their logits."""
    runner = StaticRunner(model, rows=1, slots=64)
    logits = [runner.forward_rows([(ids, None)], [1])[0][-1]]
    tokens = [int(logits[-1].argmax())]
    for _ in range(new - 1):
        logits.append(runner.forward_rows([([tokens[-1]], None)], [1])[0][-1])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


def _hugging_face_greedy(model, ids: list[int], new: int, head=None) -> tuple[list[int], torch.Tensor]:
    """The same through the Hugging Face model, uncached; `head`: a head applied to its last hidden state instead."""
    tokens, logits = [], []
    with torch.no_grad():
        for _ in range(new):
            sequence = torch.tensor([ids + tokens])
            if head is None:
                last = model(sequence).logits[0, -1]
            else:
                last = head(model.model(sequence).last_hidden_state[0, -1])
            logits.append(last.double())
            tokens.append(int(last.argmax()))
    return tokens, torch.stack(logits)


def test_a_float32_head_over_a_bfloat16_model_gives_the_float32_heads_tokens():
    """transformers' own forward refuses the mix (a dtype error); ours multiplies the bfloat16 rows by the float32
    head in float32 (the weight never read as bfloat16): the tokens of the model's bfloat16 layers and float32 head."""
    model = _llama(torch.bfloat16)
    model.lm_head.float()
    with pytest.raises(RuntimeError):
        model(torch.tensor([prompt(1, 5)]))
    ids = prompt(1, 12)
    ours, our_logits = _greedy(model, ids, 8)
    theirs, their_logits = _hugging_face_greedy(model, ids, 8, head=lambda h: model.lm_head(h.float()))
    assert our_logits.dtype == torch.float32
    assert ours == theirs
    # the bfloat16 layers' rounding apart (torch's and ours): far from the 4.76 of the head read as bfloat16
    assert (our_logits[0].log_softmax(-1).double() - their_logits[0].log_softmax(-1)).abs().max() < 0.3


def test_float16_and_float64_activations_are_multiplied_in_float32_and_returned_in_their_dtype():
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(37, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(5, 64, generator=g)
    for dtype in (torch.float16, torch.float64):
        y = native.gemm(x.to(dtype), weight, None)
        assert y.dtype == dtype and torch.equal(y, native.gemm(x.to(dtype).float(), weight, None).to(dtype))
    with pytest.raises(TypeError, match="weight must be bfloat16"):
        native.gemm(x, weight.float(), None)


def test_gemm_takes_torchs_product_under_specdec_native_0(monkeypatch):
    g = torch.Generator().manual_seed(2)
    weight, x = torch.randn(8, 64, generator=g).to(torch.bfloat16), torch.randn(3, 64, generator=g)
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    called = []
    monkeypatch.setattr(native, "_library", lambda: called.append(1) or (None, "off"))
    assert torch.allclose(native.gemm(x, weight, None), x @ weight.float().T, atol=1e-5) and not called


def test_column_major_weights_give_the_row_major_models_logits(monkeypatch):
    """o_proj and down_proj stored column-major (the same values): the lean forward makes them contiguous at build
    (the model's own parameters, so loads in place still reach them), and the native stack reads the same bits."""
    monkeypatch.setattr(native, "bfloat16_arithmetic", lambda: False)  # float32 over bfloat16: the stack runs
    model = _llama(torch.bfloat16)
    column_major = copy.deepcopy(model)
    for layer in column_major.model.layers:
        for linear in (layer.self_attn.o_proj, layer.mlp.down_proj):
            linear.weight.data = linear.weight.data.t().contiguous().t()
        layer.input_layernorm.weight.data = torch.stack([layer.input_layernorm.weight.data] * 2, 1)[:, 0]
    assert not column_major.model.layers[0].self_attn.o_proj.weight.is_contiguous()
    ids = prompt(2, 10)
    expected, expected_logits = _greedy(model, ids, 6)
    tokens, logits = _greedy(column_major, ids, 6)
    assert lean_decoder(column_major).stack is not None
    assert tokens == expected and torch.equal(logits, expected_logits)


def _passes_slots(lean, rows: int, width: int, write_index: torch.Tensor, slots: int) -> tuple[PassSlots, StaticKV]:
    positions = torch.arange(width).expand(rows, width)
    mask = torch.zeros(rows, 1, width, slots, dtype=lean.dtype)
    return PassSlots(positions, mask, write_index, None), StaticKV(rows=rows, slots=slots)


@pytest.mark.parametrize("stacked", [True, False], ids=["native_stack", "python_layers"])
def test_a_slot_out_of_range_is_refused_before_anything_is_written(stacked, monkeypatch):
    monkeypatch.setattr(native, "bfloat16_arithmetic", lambda: False)
    model = _llama(torch.bfloat16)
    forget(model)
    lean = lean_decoder(model)
    assert lean.stack is not None
    if not stacked:
        lean.stack = None
    ids = torch.tensor([prompt(3, 4)])
    for bad in (16, 99, -1):
        slots, kv = _passes_slots(lean, 1, 4, torch.tensor([[0, 1, 2, bad]]), 16)
        with pytest.raises(ValueError, match=f"write_index holds {bad}, outside 0..15"):
            lean(ids, slots, kv, 1)
        assert all(keys.abs().sum() == 0 for keys in kv.keys)  # not a key written
    forget(model)


@pytest.mark.subprocess
def test_past_the_buffer_under_python_O_the_runner_refuses_with_one_line():
    """`python -O` drops asserts: the runner's check that a pass fits its buffer is not one (nor the lean forward's own,
    `test_a_slot_out_of_range_is_refused_before_anything_is_written`), so the refusal stands there too."""
    script = ("import torch\n"
              "from tests.test_native_boundary import _llama\n"
              "from utils.runners.static import StaticRunner\n"
              "runner = StaticRunner(_llama(torch.float32), rows=1, slots=8)\n"
              "runner.forward_rows([([5, 6, 7, 8, 9, 10], None)], [1])\n"
              "try:\n"
              "    runner.forward_rows([([11, 12, 13, 14], None)], [1])\n"
              "except ValueError as error:\n"
              "    print('refused:', error)\n")
    root = Path(__file__).resolve().parent.parent
    # This session's cache folder (conftest.py: its kernel tables); the -O bytecode of torch and transformers kept in
    # the user's cache (none is installed: compiled again on every run, ~15 s, where PYTHONDONTWRITEBYTECODE is set).
    user = Path(USER_CACHE) if USER_CACHE else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / \
        "speculative-decoding"
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(user / "bytecode-optimized")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    done = subprocess.run([sys.executable, "-O", "-c", script], capture_output=True, text=True, cwd=root, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: the static buffer holds 8 slots a row: a pass of 4 tokens after 6 does not fit" in done.stdout


@pytest.mark.parametrize("assign", [True, False], ids=["assigned", "in_place"])
def test_weights_loaded_after_a_first_generation_give_the_new_models_tokens(assign):
    model, other = _llama(torch.float32, seed=0), _llama(torch.float32, seed=1)
    ids = prompt(4, 10)
    first, _ = _greedy(model, ids, 6)
    expected, expected_logits = _greedy(other, ids, 6)
    assert first != expected  # two models apart
    model.load_state_dict(copy.deepcopy(other.state_dict()), assign=assign)
    tokens, logits = _greedy(model, ids, 6)
    assert tokens == expected and torch.allclose(logits, expected_logits, atol=1e-5)
    hugging_face, _ = _hugging_face_greedy(other, ids, 6)
    assert tokens == hugging_face


def test_a_parameter_replaced_without_load_state_dict_is_seen():
    model, other = _llama(torch.float32, seed=0), _llama(torch.float32, seed=1)
    ids = prompt(5, 10)
    _greedy(model, ids, 2)
    built = lean_decoder(model)
    model.lm_head.weight = torch.nn.Parameter(other.lm_head.weight.detach().clone(), requires_grad=False)
    assert lean_decoder(model) is not built
    assert lean_decoder(model) is lean_decoder(model)  # and kept again
