"""A prompt's attention over itself in our blocked kernel (`flash.c` through `layer_ops.flash_attention`), the
measurement that chooses it over torch's (`utils/lean/flash.py`), and a bfloat16 prompt's pass that takes it."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tests.conftest import require_native, torch_threads
from tests.models import VOCAB, prompt
from utils.lean import flash, kernels, layer_ops, lean_decoder, native
from utils.runners.static import StaticRunner


def _inputs(heads: int, kv_heads: int, head_dim: int, width: int, start: int, seed: int = 0):
    """q laid out as the rotary step writes it ((1, width, heads, head_dim) seen as (1, heads, width, head_dim)), the
    buffer's keys and values with a few slots past the prompt."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, width, heads, head_dim, generator=generator).bfloat16().transpose(1, 2)
    keys, values = (torch.randn(1, kv_heads, start + width + 3, head_dim, generator=generator).bfloat16()
                    for _ in range(2))
    return q, keys, values


def _softmax_attention(q, keys, values, start: int) -> torch.Tensor:
    """The float64 reference: each query over the keys up to its own position -> (1, width, heads * head_dim)."""
    _, heads, width, head_dim = q.shape
    group, used = heads // keys.shape[1], start + width
    k, v = (t[0, :, :used].double().repeat_interleave(group, 0) for t in (keys, values))
    scores = q[0].double() @ k.transpose(1, 2) * head_dim ** -0.5
    hidden = torch.arange(used)[None] > torch.arange(start, used)[:, None]
    out = scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v
    return out.transpose(0, 1).reshape(1, width, heads * head_dim)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "width", "start"),
                         [(12, 2, 128, 100, 0), (4, 4, 64, 37, 5), (8, 1, 32, 70, 0), (16, 2, 256, 50, 0),
                          (6, 3, 96, 33, 60)])
def test_the_blocked_attention_is_the_softmax_within_bfloat16s_rounding(heads, kv_heads, head_dim, width, start):
    """Within 2^-7 of the largest value it weighs (its softmax's weights and its output each rounded to bfloat16,
    2^-9 apiece): the one-token kernel's bfloat16 tolerance (tests/native/test_kernels.c)."""
    require_native()
    q, keys, values = _inputs(heads, kv_heads, head_dim, width, start)
    with torch_threads(2):
        out = layer_ops.flash_attention(q, keys, values, start, head_dim ** -0.5)
    error = (out.double() - _softmax_attention(q, keys, values, start)).abs().max()
    assert out.shape == (1, width, heads * head_dim) and error <= values.abs().max() / 128


def test_each_querys_bits_depend_on_its_position_and_keys_alone():
    """The first queries of a prompt alone, on another thread count, from a contiguous q: the same bits."""
    require_native()
    q, keys, values = _inputs(12, 2, 128, 90, 0)
    scale = 128 ** -0.5
    with torch_threads(2):
        whole = layer_ops.flash_attention(q, keys, values, 0, scale)
    first = layer_ops.flash_attention(q[:, :, :41].contiguous(), keys, values, 0, scale)
    assert torch.equal(first, whole[:, :41])


def test_bad_arguments_are_named_before_the_kernel_runs():
    require_native()
    q, keys, values = _inputs(4, 2, 64, 10, 0)
    cases = [
        ((q.float(), keys, values, 0), "q must be bfloat16"),
        ((q[..., :48], keys[..., :48], values[..., :48], 0), "a head size that is a positive multiple of 32"),
        ((q, keys, values, keys.shape[2] - 9), "start must be an int from 0 to slots - width = 3"),
        ((q, keys, values, -1), "start must be"),
        ((torch.cat([q] * 5, dim=1), keys, values, 0), "query heads 1 to 8 times the key heads"),
        ((q, keys.transpose(2, 3).contiguous().transpose(2, 3), values, 0), "keys must be contiguous"),
        ((q, keys, values.float(), 0), "values must be bfloat16"),
    ]
    for arguments, named in cases:
        with pytest.raises((TypeError, ValueError), match=named):
            layer_ops.flash_attention(*arguments, 0.125)


def test_a_bfloat16_prompts_pass_takes_the_chosen_kernel_and_its_logits_stay_near_torchs(monkeypatch, tmp_path):
    """One row's prompt past the one-pass width (48 tokens from slot 0), the 1.5B's heads (12 over 2 of 128) in
    bfloat16: ours where the measurement chose it and the pass computes in bfloat16, torch's otherwise; the logits
    within bfloat16's reach of each other (a kernel's rounding, not a wrong key: 2^-5 of their largest magnitude)."""
    require_native()
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # kernel tables probed small (the logits are tested, not speed)
    monkeypatch.setattr(kernels, "PROBE_BYTES", 1 << 22)
    kernels.kernel_table.cache_clear()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=1536, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    ids = prompt(3, 48)
    calls = []
    blocked = layer_ops.flash_attention
    monkeypatch.setattr(layer_ops, "flash_attention", lambda *args: calls.append(args[3]) or blocked(*args))
    logits, said = {}, {}
    for chosen in (True, False):
        monkeypatch.setattr(flash, "chosen", lambda heads, kv_heads, head_dim, chosen=chosen: chosen)
        logits[chosen] = StaticRunner(model, rows=1, slots=64).forward_rows([(ids, None)], [48])[0].float()
        said[chosen] = lean_decoder(model).prompt_attention()  # what a report says ran
    # one layer's attention, from slot 0, when ours was chosen and the pass computes in bfloat16 (without bfloat16
    # arithmetic the bfloat16 weights compute in float32: torch's kernel either way)
    assert calls == ([0] if native.bfloat16_arithmetic() else [])
    assert said[True].startswith("ours" if native.bfloat16_arithmetic() else "torch's") and said[False].startswith("torch's")
    apart = (logits[True] - logits[False]).abs().max()
    assert apart <= logits[False].abs().max() / 32
    # the same next token wherever torch's top two logits are further apart than the kernels are (45 of 48 here)
    top = logits[False].topk(2, dim=-1).values
    clear = top[:, 0] - top[:, 1] > 2 * apart
    assert clear.sum() >= len(ids) // 2 and torch.equal(logits[True].argmax(-1)[clear], logits[False].argmax(-1)[clear])
    kernels.kernel_table.cache_clear()


def test_the_choice_is_measured_once_per_machine_and_shape_and_kept(monkeypatch, tmp_path):
    """`flash.chosen`: timed once and kept under the cache (every later process takes the same kernel); heads the
    kernel does not take, or our kernels off, choose torch's untimed. The real timing returns both kernels' times."""
    require_native()
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    timings = []
    monkeypatch.setattr(flash, "_time", lambda *shape: timings.append(shape) or (1.0, 2.0))
    try:
        for _ in range(3):  # three "processes"
            flash.chosen.cache_clear()
            assert flash.chosen(12, 2, 128)
        kept = [path for path in tmp_path.glob("kernels/*.json") if '"ours"' in path.read_text()]
        assert timings == [(12, 2, 128)] and len(kept) == 1
        assert flash.chosen(4, 4, 64) and timings[-1] == (4, 4, 64)  # another shape: its own timing
        assert not flash.chosen(12, 2, 80) and not flash.chosen(18, 2, 128) and len(timings) == 2
        flash.chosen.cache_clear()
        monkeypatch.setenv(native.NATIVE_ENV, "0")
        assert not flash.chosen(8, 1, 128) and len(timings) == 2
    finally:
        flash.chosen.cache_clear()
    monkeypatch.undo()
    monkeypatch.setattr(flash, "WIDTH", 64)
    assert all(0 < seconds < 5 for seconds in flash._time(4, 2, 32))
