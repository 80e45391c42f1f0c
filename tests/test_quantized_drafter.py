"""The self-drafter (`sampling.quantized_drafter`, sampling/drafters/self_drafting.py) and the quantized linears under
it (utils/quantize.py): the kernels against the float layers, the fallback where int4 cannot run, the
shared tensors, exactness (greedy identity with plain greedy decoding for chains, adaptive drafting,
ragged batches, trees, the cascade and the static buffer; the sampling law; seeds), the drafter's own
prompt pass gone where it drafts over the target's cache, the disk cache, `bits="auto"`,
`load_model(quantize=)`, and bad arguments refused by name.

The tiny models (hidden 32, MLP 64, vocabulary 96) have widths our int4 kernel takes in groups of 32 (any output
width, inputs a multiple of 32); in groups of 64 it takes only the MLP's down product (64 inputs), and torch's int4
kernel only a weight of 64 inputs whose rows are a multiple of 16, so a head of 100 rows over 32 inputs is int8."""

import pytest
import torch
from torch import nn

from ngram_assisted import MultiDynaGram, ngram_assisted_speculative_generate
from sampling import SpeculativeStats, autoregressive_generate, quantized_drafter, speculative_generate
from sampling.drafters.self_bits import expected_speedup
from sampling.drafters.self_drafting import self_drafter, self_drafting
from tests.cost_tables import BF16_15B, fix_costs
from tests.models import prompt, tiny_model
from tests.saved_model import save_tiny_chat_model
from tests.stats_helpers import P_VALUE_THRESHOLD, chi_square_p_value, exact_two_token_distribution, first_two_tokens
from tests.test_drafter_invariant import seeded
from tests.test_validation import no_forward  # noqa: F401  (a fixture)
from utils.lean import native
from utils.loading import load_model
from utils.logits_processors import NucleusProcessor
from utils.quantize import QuantizedLinear, quantize_int4
from utils.quantized_models import quantize_linears
from utils.runners import StaticRunner, make_runner
from utils.runners.passes import ModelPasses

FAMILIES = ["llama", "qwen2", "gpt2"]
INT8_TOLERANCE = 0.02  # max |y_int8 - y| / max |y|: 8-bit per-channel scales
INT4_TOLERANCE = 0.15  # max |y_int4 - y| / max |y|: 4-bit groups of 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bits,tolerance", [(8, INT8_TOLERANCE), (4, INT4_TOLERANCE)])
def test_a_quantized_linear_is_close_to_the_float_one_in_the_input_dtype(dtype, bits, tolerance):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96).to(dtype)
    layer = quantize_linears(nn.Sequential(linear), bits, 32, cache=False)["0"]
    assert layer.bits == bits
    x = torch.randn(5, 3, 64, dtype=dtype)
    with torch.no_grad():
        y, reference = layer(x), linear(x)
    assert y.dtype == dtype and y.shape == reference.shape
    assert float((y - reference).abs().max() / reference.abs().max()) < tolerance


def test_the_int4_kernel_computes_the_dequantized_product():
    torch.manual_seed(1)
    weight, x = torch.randn(32, 64), torch.randn(4, 64)
    packed, scales_and_zeros = quantize_int4(weight, 32)
    scales, zeros = scales_and_zeros[..., 0].t(), scales_and_zeros[..., 1].t()  # (N, K / 32)
    groups = weight.reshape(32, 2, 32)
    low = groups.amin(-1)
    q = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 15)
    dequantized = ((q - 8) * scales[..., None] + zeros[..., None]).reshape(32, 64)
    layer = QuantizedLinear(4, 64, 32, packed, scales_and_zeros, None, group_size=32, dtype=torch.float32)
    # A float32 layer feeds the kernel bfloat16 activations (its fast path) and gets a bfloat16 product back.
    scales, zeros = scales.bfloat16().float(), zeros.bfloat16().float()  # held in the compute dtype too
    dequantized = ((q - 8) * scales[..., None] + zeros[..., None]).reshape(32, 64)
    exact = x.bfloat16().float() @ dequantized.T
    assert layer(x).dtype == torch.float32 and torch.allclose(layer(x), exact, rtol=1e-2, atol=2e-2)
    assert not torch.allclose(layer(x), x @ weight.T, atol=0.5)  # and it is the four-bit weight's product


def test_a_head_quantized_a_slice_of_rows_at_a_time_has_the_bytes_of_one_go(monkeypatch):
    """A head wider than `ROWS_AT_ONCE` rows is quantized in slices (its float32 copies bounded): the same packed
    bytes, scales and minimums as all its rows at once, the last group padded as before."""
    import utils.quantize as quantize

    weight = torch.randn(8 * 16 + 5, 64, dtype=torch.bfloat16)  # eight whole groups and a padded one
    whole = quantize.quantize_int4_native(weight, 32)
    monkeypatch.setattr(quantize, "ROWS_AT_ONCE", 2 * 16)
    sliced = quantize.quantize_int4_native(weight, 32)
    assert all(torch.equal(a, b) for a, b in zip(whole, sliced, strict=True)) and whole[0].shape[0] == 9


def test_a_head_no_int4_kernel_takes_falls_back_to_int8_and_stays_exact():
    target = tiny_model("llama", vocab=100)
    drafter = quantized_drafter(target, group_size=64)  # the head's 32 inputs: no group of 64; 100 rows: not torch's
    down, head = drafter.model.layers[0].mlp.down_proj, drafter.lm_head
    assert (head.bits, down.bits, down.kernel) == (8, 4, "native" if native.supports_q4(64, 64) else "torch")
    inputs = prompt(0, vocab=100)
    reference = autoregressive_generate(inputs, target, max_gen_len=16)
    assert speculative_generate(inputs, drafter, target, gamma=4, max_gen_len=16)[0] == reference


@pytest.mark.parametrize("name", FAMILIES)
def test_the_drafter_shares_the_targets_tensors_and_leaves_it_untouched(name):
    target = tiny_model(name)
    before = target(torch.tensor([prompt(0)])).logits
    drafter = quantized_drafter(target)
    embedding = drafter.get_input_embeddings().weight
    assert embedding is target.get_input_embeddings().weight
    assert embedding.data_ptr() == target.get_input_embeddings().weight.data_ptr()
    assert isinstance(drafter.get_output_embeddings(), QuantizedLinear)
    assert not any(isinstance(m, QuantizedLinear) for m in target.modules())
    assert torch.equal(target(torch.tensor([prompt(0)])).logits, before)
    quantized = [m for m in drafter.modules() if isinstance(m, QuantizedLinear)]
    assert quantized and all(m.bits == 4 for m in quantized)


def _greedy_cases(monkeypatch, target, drafter, rows, **call):
    # Fixed costs (no timing moves them): a drafted token priced as a 4-bit 1.5B's, a quarter of a target
    # pass, or a tiny drafter costing what its tiny target costs would never draft with adaptive_gamma.
    fix_costs(monkeypatch, BF16_15B, 0.25)
    references = [autoregressive_generate(row, target, max_gen_len=20) for row in rows]
    for kwargs in ({"gamma": 4}, {"gamma": 4, "adaptive_gamma": True}, {"gamma": 4, "branching": 2},
                   {"gamma": 3, "cascade": True}, {"gamma": 5, "adaptive_gamma": True, "cascade": True}):
        for row, reference in zip(rows, references, strict=True):
            assert speculative_generate(row, drafter, target, max_gen_len=20, **kwargs, **call)[0] == reference, kwargs
        stats = SpeculativeStats()
        batch = speculative_generate(rows, drafter, target, max_gen_len=20, stats=stats, **kwargs, **call)
        assert [ids for ids, _ in batch] == references, kwargs
        assert stats.drafts_accepted > 0, kwargs


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("share_cache", [True, False])
def test_greedy_output_is_plain_greedy_output(monkeypatch, name, share_cache):
    """Chains, adaptive drafting, trees, the cascade; one row and a batch of 3 ragged rows."""
    target = tiny_model(name)
    _greedy_cases(monkeypatch, target, "self", [prompt(0), prompt(1, length=5), prompt(2, length=17)],
                  share_cache=share_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_greedy_identity_over_the_static_buffer_and_in_float32(monkeypatch, dtype):
    target = tiny_model("qwen2", dtype=dtype)
    assert isinstance(make_runner(target, max_tokens=50), StaticRunner)  # the drafter writes into its slots
    _greedy_cases(monkeypatch, target, quantized_drafter(target, bits=8), [prompt(3), prompt(4, length=6)])


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_the_hybrid_with_the_self_drafter_is_plain_greedy(monkeypatch, name):
    """The pool's draft or the four-bit model's, per step and row (`ngram=`), over the target's cache; the drafter
    a `quantized_drafter` or "self" (the one built once and kept on the target)."""
    fix_costs(monkeypatch, BF16_15B, 0.25)
    target = tiny_model(name)
    rows = [prompt(0) * 2, prompt(1, length=5)]
    references = [autoregressive_generate(row, target, max_gen_len=20) for row in rows]
    for drafter in (quantized_drafter(target), "self"):
        for adaptive in (False, True):
            batch = speculative_generate(rows, drafter, target, gamma=4, adaptive_gamma=adaptive, max_gen_len=20,
                                         ngram=MultiDynaGram(8))
            assert [ids for ids, _ in batch] == references


def _pass_widths(monkeypatch, drafter) -> list[int]:
    """The new tokens of each pass of `drafter`, whichever forward runs it (ours or the Hugging Face one)."""
    widths, run = [], ModelPasses.run

    def counted(self, ids, kwargs, **options):
        if self.model is drafter:
            widths.append(ids.shape[1])
        return run(self, ids, kwargs, **options)

    monkeypatch.setattr(ModelPasses, "run", counted)
    return widths


@pytest.mark.parametrize("share_cache", [True, False])
def test_over_the_targets_cache_the_drafter_makes_no_prompt_pass(monkeypatch, share_cache):
    fix_costs(monkeypatch, BF16_15B, 0.25)  # no calibration: every pass of the drafter counted is a drafting one
    target = tiny_model("llama")
    drafter = quantized_drafter(target)
    widths = _pass_widths(monkeypatch, drafter)
    stats = SpeculativeStats()
    speculative_generate(prompt(0, length=20), drafter, target, gamma=4, max_gen_len=20, stats=stats,
                         share_cache=share_cache)
    assert stats.drafts_accepted > 0 and stats.drafter_forwards == len(widths)
    assert (max(widths) == 1) == share_cache  # its own cache: the first pass reads the prompt


def test_seeds_reproduce_and_the_invariant_rule_is_plain_sampling():
    target = tiny_model("qwen2")
    drafter = quantized_drafter(target)
    processor = NucleusProcessor(temperature=0.7, top_p=0.9)
    for seed, row in enumerate([prompt(5), prompt(6, length=7)]):
        plain = autoregressive_generate(row, target, max_gen_len=16, logits_processor=processor, generator=seeded(seed))
        runs = [speculative_generate(row, drafter, target, gamma=4, max_gen_len=16, logits_processor=processor,
                                     generator=seeded(seed))[0] for _ in range(2)]
        assert runs[0] == runs[1]
        coupled, _ = speculative_generate(row, drafter, target, gamma=4, adaptive_gamma=True, max_gen_len=16,
                                          logits_processor=processor, generator=seeded(seed), drafter_invariant=True)
        assert coupled == plain


@pytest.mark.slow
@pytest.mark.parametrize("name,share_cache,branching", [("llama", True, 1), ("gpt2", False, 1), ("qwen2", True, 2)])
def test_the_first_two_tokens_follow_the_target_law(name, share_cache, branching):
    """Chi-square on the joint law of the first two tokens (standard rule: q is the quantized model's),
    p-value above P_VALUE_THRESHOLD, seeded; a batch of rows per call (the shared batch's cache)."""
    target = tiny_model(name, vocab=16)
    drafter = quantized_drafter(target, bits=4)
    processor = NucleusProcessor(temperature=1.0, top_p=0.95)
    row = [3, 4, 5, 3, 4, 5, 3, 4]
    expected = exact_two_token_distribution(target, row, processor)

    def generate(rows, generator):
        return speculative_generate(rows, drafter, target, gamma=3, max_gen_len=2, logits_processor=processor,
                                    generator=generator, drafter_invariant=False, branching=branching,
                                    share_cache=share_cache)

    assert chi_square_p_value(first_two_tokens(generate, row), expected) > P_VALUE_THRESHOLD


def test_the_packed_weights_round_trip_through_the_disk_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    target = tiny_model("qwen2")
    built = quantize_linears(target, 4, 32, cache=True)
    assert len(list((tmp_path / "quantized").glob("*.pt"))) == 1

    def refuse(*args, **kwargs):
        raise AssertionError("quantized again instead of loaded")

    monkeypatch.setattr("utils.quantized_models.quantized_linear", refuse)
    loaded = quantize_linears(target, 4, 32, cache=True)
    assert loaded.keys() == built.keys()
    for name, layer in built.items():
        assert torch.equal(loaded[name].weight_q, layer.weight_q) and torch.equal(loaded[name].scales, layer.scales)
        assert loaded[name].bits == layer.bits and loaded[name].bias is layer.bias
    drafter = quantized_drafter(target, cache=True)  # from the cache: the same tokens as a fresh build
    assert speculative_generate(prompt(1), drafter, target, gamma=4, max_gen_len=12)[0] == \
        autoregressive_generate(prompt(1), target, max_gen_len=12)
    other = tiny_model("qwen2", seed=1)  # other weights, same config: another key
    monkeypatch.undo()
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    quantize_linears(other, 4, 32, cache=True)
    assert len(list((tmp_path / "quantized").glob("*.pt"))) == 2


def test_auto_bits_is_measured_once_and_follows_the_rule(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    target = tiny_model("llama")
    drafter = quantized_drafter(target, bits="auto")
    bits = drafter.config.specdec_self_drafter["bits"]
    assert bits in (4, 8)
    monkeypatch.setattr("sampling.drafters.self_bits.measure", lambda *args: pytest.fail("measured twice"))
    assert quantized_drafter(target, bits="auto").config.specdec_self_drafter["bits"] == bits
    # The rule: what agrees more pays when it costs alike; what costs less pays when it agrees alike.
    assert expected_speedup(0.9, 0.3) > expected_speedup(0.7, 0.3)
    assert expected_speedup(0.8, 0.2) > expected_speedup(0.8, 0.4)
    assert expected_speedup(0.0, 0.5) < 1 < expected_speedup(1.0, 0.0) == 6


@pytest.mark.parametrize("kwargs,error,match", [
    ({"bits": 3}, ValueError, "bits must be 4 or 8"),
    ({"bits": "four"}, ValueError, "bits must be 4 or 8"),
    ({"bits": True}, ValueError, "bits must be 4 or 8"),
    ({"group_size": 48}, ValueError, "group_size must be one of"),
    ({"group_size": "32"}, ValueError, "group_size must be one of"),
    ({"group_size": 128}, ValueError, "group_size=128 divides no linear's input width"),
    ({"bits": "auto", "group_size": 256}, ValueError, "group_size=256 divides no"),
    ({"cache": "sometimes"}, ValueError, "cache must be True, False or 'auto'"),
])
def test_bad_arguments_are_refused_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        quantized_drafter(tiny_model("llama"), **kwargs)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"bits": 3}, ValueError, "bits must be 4, 8 or 'auto'"),
    ({"bits": True}, ValueError, "bits must be 4, 8 or 'auto'"),
    ({"group_size": 48}, ValueError, "group_size must be one of"),
    ({"group_size": 128}, ValueError, "group_size=128 divides no linear's input width"),
    ({"share_cache": "yes"}, TypeError, "share_cache must be a bool"),
    ({"drafter_tokenizer": "x"}, TypeError, "drafter_tokenizer must be a transformers tokenizer"),
])
def test_the_self_drafters_options_are_refused_by_name_before_any_model_runs(no_forward, kwargs, error, match):  # noqa: F811
    with pytest.raises(error, match=match):
        speculative_generate(prompt(0), "self", tiny_model("llama"), **kwargs)


def test_a_quantized_drafter_passed_whole_keeps_its_bits_and_the_options_of_a_plain_drafter_are_refused(no_forward):  # noqa: F811
    target = tiny_model("llama")
    with pytest.raises(ValueError, match="bits=8, but the drafter is a quantized_drafter built with bits=4"):
        speculative_generate(prompt(0), quantized_drafter(target), target, bits=8)
    with pytest.raises(ValueError, match="share_cache"):
        speculative_generate(prompt(0), tiny_model("llama", seed=1), target, share_cache=False)
    with pytest.raises(ValueError, match="encoder-decoder"):
        speculative_generate(prompt(0), "self", tiny_model("t5"))


def test_self_is_built_once_per_target_and_bits_and_is_plain_greedy(monkeypatch):
    target = tiny_model("qwen2")
    assert self_drafter(target) is self_drafter(target) is not self_drafter(target, 8)
    assert self_drafting(self_drafter(target, 8)).bits == 8
    _greedy_cases(monkeypatch, target, "self", [prompt(3)], bits=8)


def test_a_non_model_and_an_encoder_decoder_target_are_refused():
    with pytest.raises(TypeError, match="target must be a transformers PreTrainedModel"):
        quantized_drafter(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="encoder-decoder"):
        quantized_drafter(tiny_model("t5"))


def test_a_target_off_the_cpu_is_refused_by_name_and_nothing_is_cached(tmp_path, monkeypatch):
    """The kernels are CPU kernels: a target elsewhere (here the meta device) is refused before any
    work, never turned into a float 'drafter' (nor cached as one)."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    build = getattr(tiny_model, "__wrapped__", tiny_model)  # a model of its own: the shared one stays on the CPU
    target = build("llama").to("meta")
    with pytest.raises(ValueError, match="linears on meta: .* run on the CPU only"):
        quantized_drafter(target, cache=True)
    assert not any(tmp_path.rglob("*.pt"))


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("chat"), max_positions=256, hidden=64)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_quantized_target_runs_every_method_exactly(chat_folder, kind):
    model, tokenizer = load_model(str(chat_folder), dtype="float32", quantize=kind)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and {m.bits for m in layers} == {int(kind[3:])}
    inputs = tokenizer("w5 w6 w7 w5 w6 w7 w5")["input_ids"]
    reference = autoregressive_generate(inputs, model, max_gen_len=12)
    assert ngram_assisted_speculative_generate(inputs, MultiDynaGram(3), model, max_gen_len=12)[0] == reference
    assert speculative_generate(inputs, model, model, gamma=3, max_gen_len=12)[0] == reference
    assert speculative_generate(inputs, model, model, gamma=3, max_gen_len=12, cascade=True)[0] == reference
    with pytest.raises(ValueError, match="quantized already"):
        quantized_drafter(model)


def test_load_model_refuses_a_bad_quantize_by_name(chat_folder):
    with pytest.raises(ValueError, match="quantize must be None or one of"):
        load_model(str(chat_folder), quantize="int3")
    with pytest.raises(ValueError, match="two quantizations"):
        load_model(str(chat_folder), quantize="int8", load_in_8bit=True)
    with pytest.raises(ValueError, match="CPU kernels"):
        load_model(str(chat_folder), quantize="int4", device_map="auto")


def test_the_drafters_group_is_64_where_our_kernel_takes_every_linear_so():
    """Unless told, 4.5 bits a weight (a scale and a minimum per 64 inputs) where every linear's input width allows
    it and our kernel runs here, else 32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sampling.drafters.self_drafting import self_drafting
    from utils.quantized_models import drafter_group

    assert drafter_group(tiny_model("llama")) == 32  # hidden 32: no group of 64 there
    torch.manual_seed(0)
    wide = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()
    expected = 64 if native.supports_q4(64, 64) else 32
    assert drafter_group(wide) == expected
    drafter = quantized_drafter(wide)
    assert self_drafting(drafter).group_size == expected == drafter.config.specdec_self_drafter["group_size"]
    assert self_drafting(quantized_drafter(wide, group_size=32)).group_size == 32
