"""Our own forward (`utils/lean/`) against the Hugging Face model it reads: the same logits to float64 rounding for
every family it covers (Gemma 2 and 3 with sliding and full layers mixed, a window shorter than the sequences), over
chains, trees and ragged batches in the static buffer; the model's own weights unchanged (fused into views, no second
copy); the fallback said in one line."""

from __future__ import annotations

import copy

import pytest
import torch
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

from tests.conftest import require_native
from tests.models import SMALL, VOCAB, gemma_config, phi3_rope, prompt, tiny_model
from utils import settings
from utils.lean import LEAN_ENV, forget, forward_path, lean_decoder
from utils.runners.factory import make_runner
from utils.runners.static import StaticRunner

TOLERANCE = 1e-10  # float64 logits of size ~10: only the summation order may differ
# The model's eager attention takes its softmax in float32 (the lean forward does the same): over a buffer of
# another length the float32 sums round differently.
EAGER_TOLERANCE = 1e-5


def _extra_model(name: str, attention: str, seed: int = 0):
    """Families and options the suite's tiny models lack: Qwen3's q/k norms, Llama-3 rope scaling, tied heads, Phi-3's
    fused projections (and its longrope), the Gemma family (`gemma_config`; Gemma 2 always eager: transformers runs no
    other attention for it)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=256,
                  num_key_value_heads=2, initializer_range=0.3, **SMALL)
    if name.startswith("gemma"):
        config, model_class = gemma_config(name, common)
        config._attn_implementation = "eager" if name == "gemma2" else attention
        model = model_class(config).to(torch.float64).eval()
        with torch.no_grad():  # Gemma's norms start at 0 (a weight of 1 + 0): random, so that (1 + weight) is seen
            for parameter_name, parameter in model.named_parameters():
                if "norm" in parameter_name:
                    parameter.normal_(0.0, 0.3)
        model.generation_config.pad_token_id = 0
        model.generation_config.eos_token_id = None
        return model
    if name == "qwen3":
        config = Qwen3Config(head_dim=16, **common)
        model_class = Qwen3ForCausalLM
    elif name.startswith("phi3"):  # q/k/v and gate/up held fused; "longrope": short factors to 16, long after;
        # "partial": half of each head turned (Phi-4-mini turns 0.75)
        turned = 0.5 if "partial" in name else 1.0
        pairs = int(common["hidden_size"] / common["num_attention_heads"] * turned) // 2
        longrope = {"short_factor": [1.0 + i / 8 for i in range(pairs)], "long_factor": [2.0 + i for i in range(pairs)]}
        rope = phi3_rope(turned, longrope if "longrope" in name else None)
        config = Phi3Config(sliding_window=None, original_max_position_embeddings=16, **rope, **common)
        model_class = Phi3ForCausalLM
    else:
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64, "rope_theta": 10000.0}
        config = LlamaConfig(rope_scaling=rope, tie_word_embeddings=True, **common)
        model_class = LlamaForCausalLM
    config._attn_implementation = attention
    return model_class(config).to(torch.float64).eval()


FAMILIES = ["llama", "qwen2", "mistral", "qwen3", "llama3-tied", "phi3", "phi3-partial", "gemma", "gemma2", "gemma3"]


def _model(name: str, attention: str):
    if name in ("llama", "qwen2", "mistral"):
        return tiny_model(name, attention=attention)
    return _extra_model(name, attention)


def _reference(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_chains_equal_the_hugging_face_logits(family, attention):
    model = _model(family, attention)
    assert forward_path(model).startswith(f"lean forward ({'gemma' if family.startswith('gemma') else 'llama'}.py")
    ids = prompt(1, 30)
    reference = _reference(model, ids)
    runner = StaticRunner(model, rows=1, slots=128)
    pieces = [runner.forward_rows([(ids[a:b], None)], [b - a])[0] for a, b in ((0, 11), (11, 12), (12, 20))]
    runner.rollback_row(0, 16)  # the rejected tail is overwritten
    pieces[-1] = pieces[-1][:4]
    pieces.append(runner.forward_rows([(ids[16:30], None)], [14])[0])
    eager = model.config._attn_implementation == "eager"
    assert (torch.cat(pieces) - reference).abs().max() < (EAGER_TOLERANCE if eager else TOLERANCE)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "phi3", "gemma", "gemma2", "gemma3"])
def test_a_ragged_batch_with_a_tree_equals_each_row_alone(family):
    """Row 0 verifies a tree (two branches), row 1 a chain; each node's logits are those of its path (Gemma 2 and
    3: rows longer than their sliding layers' window)."""
    model = _model(family, "sdpa")
    tolerance = EAGER_TOLERANCE if model.config._attn_implementation == "eager" else TOLERANCE
    first, second = prompt(2, 9), prompt(3, 14)
    runner = StaticRunner(model, rows=2, slots=128)
    runner.forward_rows([(first, None), (second, None)], [1, 1])
    tree_tokens, parents = [5, 6, 7, 8], [-1, 0, 0, 2]  # 5 -> (6, 7 -> 8)
    logits = runner.forward_rows([(tree_tokens, parents), ([9, 10, 11], None)], [4, 3])
    for node, path in ((1, [5, 6]), (3, [5, 7, 8])):
        assert (logits[0][node] - _reference(model, first + path)[-1]).abs().max() < tolerance
    assert (logits[1] - _reference(model, second + [9, 10, 11])[-3:]).abs().max() < tolerance
    runner.keep_path_row(0, len(first), [1, 2])  # keep 5 -> 7 -> 8 (nodes after the root), then go on
    after = runner.forward_rows([([12], None), ([], None)], [1, 0])[0]
    assert (after[0] - _reference(model, first + [5, 7, 8, 12])[-1]).abs().max() < tolerance


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("name", ["phi3-longrope", "phi3-longrope-partial"])
def test_longrope_turns_each_position_as_token_by_token_decoding_does(name, attention):
    """A longrope model's rotary module takes its long factors for a whole pass once it reaches past the original
    context (16 here): decoding token by token, each position gets the short factors before 16 and the long ones from
    it. The lean forward's rows are those at any width (a prompt within 16, then passes of 1 to 6 tokens across it)."""
    model = _extra_model(name, attention)
    ids = prompt(5, 34)
    with torch.no_grad():  # the model's own passes: the prompt, then one token a pass over its cache
        out = model(input_ids=torch.tensor([ids[:10]]), use_cache=True)
        reference, cache = [out.logits[0]], out.past_key_values
        for token in ids[10:]:
            out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            reference.append(out.logits[0])
    reference = torch.cat(reference)
    runner = StaticRunner(model, rows=1, slots=64)
    pieces, at = [], 0
    for width in (10, 3, 1, 6, 2, 5, 4, 3):  # across position 16 inside a pass of 6 (12..17)
        pieces.append(runner.forward_rows([(ids[at:at + width], None)], [width])[0])
        at += width
    assert at == len(ids)
    tolerance = EAGER_TOLERANCE if attention == "eager" else TOLERANCE
    assert (torch.cat(pieces) - reference).abs().max() < tolerance
    whole = _reference(model, ids)  # one pass past 16: the long factors throughout, so its first 16 rows differ
    assert (whole[:16] - reference[:16]).abs().max() > 1e-3


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
def test_a_partial_rotary_step_turns_each_heads_first_dimensions_in_our_rotary_step(weights, monkeypatch):
    """Phi-4-mini turns 96 of each head's 128 dimensions: our rotary step (rope.c) turns a head's first ones and passes
    the rest, as the model does. A Phi-3 turning 12 of 16 gives the model's float32 logits to float32 rounding: in
    float32 through our layers, and over bfloat16 weights computed in float32 (an AVX2-only CPU's path) with every
    layer in one native call."""
    from utils.lean import native

    require_native()
    monkeypatch.setattr(native, "bfloat16_arithmetic", lambda: False)
    torch.manual_seed(0)
    config = Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                        initializer_range=0.3, **phi3_rope(0.75))
    config._attn_implementation = "sdpa"
    model = Phi3ForCausalLM(config).eval().to(weights)
    ids = prompt(1, 30)
    with torch.no_grad():  # the model in float32 over the same weights' values
        reference = copy.deepcopy(model).float()(input_ids=torch.tensor([ids])).logits[0]
    lean = lean_decoder(model)
    assert lean.native and (lean.stack is not None) == (weights == torch.bfloat16), forward_path(model)
    runner = StaticRunner(model, rows=1, slots=64)
    ours = torch.cat([runner.forward_rows([(ids[a:b], None)], [b - a])[0] for a, b in ((0, 11), (11, 12), (12, 30))])
    assert ours.dtype == torch.float32 and (ours - reference).abs().max() < 1e-4


def test_parts_that_do_not_split_one_modules_outputs_are_refused():
    from torch import nn

    from utils.lean.linear import Linear

    module = nn.Linear(16, 8)
    assert Linear([module], parts=[3, 5]).widths == [3, 5]
    for modules, parts in (([module], [3, 4]), ([module, nn.Linear(16, 8)], [8, 8])):
        with pytest.raises(ValueError, match="must split one module's 8 outputs"):
            Linear(modules, parts=parts)


def test_fused_weights_are_the_models_own():
    """q/k/v and gate/up become one tensor each; the model's parameters are views into it: same values, no copy."""
    model = _extra_model("llama3-tied", "sdpa")
    attention = model.model.layers[0].self_attn
    before = attention.k_proj.weight.detach().clone()
    reference = _reference(model, prompt(4, 10))
    bytes_before = sum(p.untyped_storage().nbytes() for p in {p.untyped_storage().data_ptr(): p for p in model.parameters()}.values())
    lean = lean_decoder(model)
    assert torch.equal(attention.k_proj.weight, before)
    assert attention.k_proj.weight.untyped_storage().data_ptr() == lean.layers[0].qkv.weight.untyped_storage().data_ptr()
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    assert sum(storages.values()) == bytes_before
    assert torch.equal(_reference(model, prompt(4, 10)), reference)  # the Hugging Face path runs as before


def test_weights_move_to_huge_pages_once_and_a_tied_head_stays_tied():
    """A weight of a huge page or more is moved to memory advised for huge pages (`huge_pages.py`) where the kernel
    gives them: the same values, one copy, and a head tied to the embedding still one parameter."""
    from utils.lean import huge_pages

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16384, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).float().eval()  # a 4 MB head (16384 x 64 float32): two huge pages
    head = model.lm_head.weight.detach().clone()
    reference = _reference(model, prompt(4, 10, vocab=16384))
    lean_decoder(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight and torch.equal(model.lm_head.weight, head)
    moved = huge_pages.thp_mode() in ("always", "madvise")
    assert (model.lm_head.weight.data_ptr() % huge_pages.HUGE_PAGE == 0) == moved
    assert torch.equal(_reference(model, prompt(4, 10, vocab=16384)), reference)
    small = torch.ones(10)
    assert huge_pages.on_huge_pages(small) is small  # under a huge page: kept as it is
    forget(model)


def test_quantized_linears_run_unfused_and_a_replaced_linear_is_seen():
    from utils.quantized_models import quantize_model

    model = _extra_model("qwen3", "sdpa").float()
    lean_decoder(model)
    quantize_model(model, "int8", cache=False)  # replaces the linears: the lean forward is built again
    ids = prompt(5, 12)
    runner = StaticRunner(model, rows=1, slots=64)
    got = runner.forward_rows([(ids, None)], [12])[0]
    assert (got - _reference(model, ids)).abs().max() < 1e-4  # float32 model; the same int8 kernel on both paths


def test_our_four_bit_linears_fuse_into_one_call_and_give_the_hugging_face_logits():
    """Our kernel's 4-bit q/k/v and gate/up (a quantized target, the self-drafter) become one packed weight each, the
    modules' buffers views into it, the biases added in the kernel: each output the bits its own module gives, and
    the logits the Hugging Face path's over the same modules (to the activations' rounding to float32 and int8)."""
    from utils.quantized_models import quantize_model

    model = copy.deepcopy(tiny_model("qwen2"))  # q/k/v with biases, 32 + 16 + 16 rows; the shared one stays float
    quantize_model(model, "int4", cache=False)
    lean = lean_decoder(model)
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    if not _our_kernels_run_here():  # torch's int4 or int8: each module runs as it is
        assert lean.layers[0].qkv.q4 is None and attention.k_proj.kernel == "torch"
        require_native()  # the rest is our 4-bit kernel's: skipped with the reason (failed under SPECDEC_REQUIRE_NATIVE=1)
    packed, scales = lean.layers[0].qkv.q4
    assert attention.k_proj.weight_q.data_ptr() == packed[2].data_ptr()  # q's two groups of 16 rows, then k's
    assert attention.v_proj.scales.data_ptr() == scales[3].data_ptr() and "weight_q" in attention.v_proj._buffers
    x = torch.randn(5, 32, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(lean.layers[0].qkv(x), torch.cat([attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)], -1))
        assert torch.equal(lean.layers[0].gate_up(x), torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], -1))
    ids = prompt(5, 12)
    runner = StaticRunner(model, rows=1, slots=64)
    got = torch.cat([runner.forward_rows([(ids[:7], None)], [7])[0], runner.forward_rows([([ids[7]], None)], [1])[0],
                     runner.forward_rows([(ids[8:], None)], [4])[0]])
    assert (got - _reference(model, ids)).abs().max() < 1e-4


def test_the_fallback_is_said_and_kept(monkeypatch):
    gpt2 = tiny_model("gpt2")
    assert forward_path(gpt2).startswith("Hugging Face forward (model type 'gpt2'")
    assert lean_decoder(gpt2) is None
    monkeypatch.setenv(LEAN_ENV, "0")
    llama = _extra_model("qwen3", "eager")
    assert forward_path(llama) == f"Hugging Face forward ({LEAN_ENV}=0)"
    assert lean_decoder(llama) is None
    forget(llama)


def test_the_runners_take_it_by_default():
    model = tiny_model("llama")
    assert isinstance(make_runner(model, rows=1, max_tokens=40), StaticRunner)
    assert isinstance(make_runner(model, rows=3, max_tokens=40), StaticRunner)
    assert not isinstance(make_runner(model, rows=1, use_cache=False, max_tokens=40), StaticRunner)


def test_every_kernel_computes_the_same_product_and_the_table_is_kept(monkeypatch, tmp_path):
    from utils.lean import kernels

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    weight, bias = torch.randn(48, 32), torch.randn(48)
    for rows in (1, 3, 8):
        x = torch.randn(rows, 32)
        expected = torch.nn.functional.linear(x, weight, bias)
        for kernel in kernels._candidates(next(b for b in kernels.BUCKETS if b >= rows), (48, 32), x.dtype):
            assert torch.allclose(kernels.apply(kernel, x, weight, bias), expected, atol=1e-5), kernel
    kernels.kernel_table.cache_clear()
    table = kernels.kernel_table((48, 32), torch.float32)
    assert len(list((tmp_path / "kernels").glob("*.json"))) == 1
    kernels.kernel_table.cache_clear()
    monkeypatch.setattr(kernels, "_measure", lambda *a: pytest.fail("measured again"))
    again = kernels.kernel_table((48, 32), torch.float32)  # a later start reads the stored table
    assert [again(r) for r in range(40)] == [table(r) for r in range(40)] and table(33) == kernels.LINEAR
    assert kernels.kernel_table((48, 32), torch.float64)(1) == kernels.LINEAR  # exact tests: transformers' kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_chosen_give_each_row_the_bits_of_any_other_width(monkeypatch, tmp_path, dtype):
    """Width invariance (asked for whatever its price): a row's product is the same bits whether the pass holds 1,
    3 or 20 rows."""
    from utils.lean import kernels

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setenv(kernels.INVARIANT_ENV, "1")
    kernels.kernel_table.cache_clear()
    weight, x = torch.randn(64, 96).to(dtype), torch.randn(32, 96).to(dtype)
    table = kernels.kernel_table((64, 96), dtype)
    reference = kernels.apply(table(32), x, weight, None)  # the chosen family's widest product
    for rows in (1, 2, 3, 5, 8, 13, 20, 32):
        assert torch.equal(kernels.apply(table(rows), x[:rows], weight, None), reference[:rows]), (rows, table(rows))
    assert all(price >= 1.0 for price in table.price.values())
    kernels.kernel_table.cache_clear()


def test_invariance_is_taken_by_default_only_where_it_costs_at_most_five_percent(monkeypatch):
    """MKL's float32 products on an AVX2-only CPU differ between widths: the only invariant one-row product is then
    a 32-row one (32 rows' arithmetic for one). Such a price turns invariance off (the fastest kernels), unless it is asked for."""
    from utils.lean import kernels

    fast, padded = ("mv", 0), kernels.REFERENCE

    def measured(invariant_seconds: float) -> dict:
        return {bucket: {"fastest": fast, "invariant": padded, "seconds": [[*fast, 1.0], [*padded, invariant_seconds]]}
                for bucket in kernels.BUCKETS}

    monkeypatch.delenv(kernels.INVARIANT_ENV, raising=False)
    dear, cheap = kernels.KernelTable(measured(7.0)), kernels.KernelTable(measured(1.04))
    assert not dear.invariant and dear(1) == fast and dear.price[1] == 7.0
    assert cheap.invariant and cheap(1) == padded
    monkeypatch.setenv(kernels.INVARIANT_ENV, "1")
    assert kernels.KernelTable(measured(7.0)).invariant
    monkeypatch.setenv(kernels.INVARIANT_ENV, "0")
    assert not kernels.KernelTable(measured(1.0)).invariant


def test_invariance_is_priced_over_the_whole_pass(monkeypatch):
    """A small matrix whose invariant kernels cost 20% more does not make a pass dearer by 20%: the model's linears
    are weighed by their seconds (and how often a pass runs them), and every table then takes the same family."""
    from types import SimpleNamespace

    from utils.lean import kernels, linear

    fast, padded = ("mv", 0), kernels.REFERENCE

    def table(fast_seconds: float, price: float) -> kernels.KernelTable:
        return kernels.KernelTable({bucket: {"fastest": fast, "invariant": padded,
                                             "seconds": [[*fast, fast_seconds], [*padded, fast_seconds * price]]}
                                    for bucket in kernels.BUCKETS})

    monkeypatch.delenv(kernels.INVARIANT_ENV, raising=False)
    small, big = table(1.0, 1.2), table(20.0, 1.0)  # the small one alone would not be invariant
    assert not small.invariant and big.invariant
    shapes = {(64, 32): small, (640, 32): big}
    monkeypatch.setattr(linear, "kernel_table", lambda shape, dtype, device: shapes[shape])
    monkeypatch.setattr(linear, "prepare", lambda weights: None)
    monkeypatch.setattr(linear.native, "bfloat16_arithmetic", lambda: True)  # the weights' dtype computes
    layers = [SimpleNamespace(weight=torch.zeros(shape, dtype=torch.bfloat16)) for shape in shapes]
    assert linear.numerics(layers, torch.bfloat16, [28, 28]) == (torch.bfloat16, True)  # (1.2 + 20) / (1 + 20) = 1.01
    assert small.invariant and small(1) == padded
    assert linear.numerics(layers, torch.bfloat16, [28, 0]) == (torch.bfloat16, False)  # the small one alone: 1.2
    assert not small.invariant and not big.invariant and big(1) == fast


@pytest.mark.parametrize(("family", "context"), [("llama", 200), ("qwen2", 200), ("qwen2", 570)])
def test_a_wide_pass_gives_each_token_the_bits_of_one_token_passes_in_bfloat16(family, context, monkeypatch, tmp_path):
    """Width invariance (asked for: by default it is taken where it costs at most 5%, which a probe this small does
    not measure reliably): greedy speculation then equals plain greedy decoding to the bit, over chains and trees."""
    from utils.lean import kernels

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setenv(kernels.INVARIANT_ENV, "1")
    monkeypatch.setattr(kernels, "PROBE_BYTES", 1 << 22)  # the bits are what is tested here, not the speed
    kernels.kernel_table.cache_clear()
    # Heads of 128 and a context of 200: the sizes at which torch's CPU attention blocks queries by their count.
    torch.manual_seed(0)
    config_class, model_class = (LlamaConfig, LlamaForCausalLM) if family == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    config = config_class(vocab_size=VOCAB, hidden_size=1536, intermediate_size=256, num_hidden_layers=1,
                          num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=1024)
    config._attn_implementation = "sdpa"
    model = model_class(config).to(torch.bfloat16).eval()
    ids, new = prompt(6, context), [5, 6, 7, 8, 9, 10, 11]  # 570: past 512 keys, the wide pass reads further
    runner = StaticRunner(model, rows=1, slots=1024)
    runner.forward_rows([(ids, None)], [1])
    wide = runner.forward_rows([(new, None)], [len(new)])[0]
    runner.rollback_row(0, len(ids))
    ones = torch.cat([runner.forward_rows([([token], None)], [1])[0] for token in new])
    assert torch.equal(wide, ones)
    # A tree: the accepted path's nodes sit after hidden siblings, then move next to their root (keep_path); each
    # node's logits and the next pass's are a chain's (attention's sums follow the keys a query sees, not slots).
    runner.rollback_row(0, len(ids))
    tree = runner.forward_rows([([new[0], 12, 13, new[1], 14, new[2]], [-1, 0, 0, 0, 3, 3])], [6])[0]
    assert torch.equal(tree[[0, 3, 5]], ones[:3])
    runner.keep_path_row(0, len(ids), [2, 4])
    assert torch.equal(runner.forward_rows([([new[3]], None)], [1])[0], ones[3:4])
    kernels.kernel_table.cache_clear()


def test_released_file_pages_read_the_same_values_again(tmp_path):
    """The pages a fused copy replaced are given back to the kernel; a file-backed tensor still reads its values,
    and memory that is not a file's is never touched."""
    from utils.lean.huge_pages import release_file_pages

    path = tmp_path / "weights.pt"
    torch.save({"w": torch.arange(1 << 20, dtype=torch.float32)}, path)
    mapped = torch.load(path, mmap=True, weights_only=True)["w"]
    anonymous = torch.arange(1 << 20, dtype=torch.float32)
    total = float(mapped.sum())
    release_file_pages([mapped, anonymous])
    assert float(mapped.sum()) == total and torch.equal(anonymous, torch.arange(1 << 20, dtype=torch.float32))


def test_a_weight_moved_onto_huge_pages_gives_its_files_pages_back_and_keeps_its_values(tmp_path, monkeypatch):
    """`on_huge_pages` copies a weight read from a mapped file (a cached self-drafter's packed weights) and gives
    the file's pages back (where huge pages cannot help it copies and releases nothing): both read the values."""
    from utils.lean import huge_pages

    path, values = tmp_path / "weights.pt", torch.arange(1 << 21, dtype=torch.float32)
    torch.save({"w": values}, path)
    mapped = torch.load(path, mmap=True, weights_only=True)["w"]
    released, release = [], huge_pages.release_file_pages
    monkeypatch.setattr(huge_pages, "release_file_pages", lambda tensors: (released.extend(tensors), release(tensors)))
    moved = huge_pages.on_huge_pages(mapped)
    assert torch.equal(moved, values) and torch.equal(mapped, values)
    assert [t is mapped for t in released] == ([] if moved is mapped else [True])


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_beam_search_runs_its_beams_through_our_forward(family):
    """Beams are rows of the static buffer (a beam continued twice is two rows): the uncached Hugging Face path's
    beams, token for token."""
    from sampling import beam_search_generate
    from utils.runners.beam import StaticBeamRunner
    from utils.runners.factory import make_beam_runner

    model = _model(family, "eager")
    assert isinstance(make_beam_runner(model, use_cache=True, costs=None, max_tokens=40), StaticBeamRunner)
    ids = prompt(7, 10)
    ours = beam_search_generate(ids, model, max_gen_len=16, top_k=3, num_beams=4, length_penalty=1.2)
    theirs = beam_search_generate(ids, model, max_gen_len=16, top_k=3, num_beams=4, length_penalty=1.2, use_cache=False)
    assert ours == theirs and len(ours) > 0


def _our_kernels_run_here() -> bool:
    """Whether our kernels build here: wherever there is a C compiler (`$CC`, cc or gcc; the C has a plain version
    for any CPU). Where they cannot, what stands in is checked instead: `unavailable()` says why, and no weight takes
    them (torch's products and int4 kernel run, as the tests of the rest of this file check)."""
    from utils.lean import build, native

    expected = build.compiler()[0] is not None and settings.current().native
    if expected:
        assert native.unavailable() is None
    else:
        assert native.unavailable() and not native.supports((64, 128), torch.bfloat16)
        assert not native.supports_q4(128, 32)
    return expected


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_our_kernel_computes_the_product_in_float32_the_same_bits_at_every_width(x_dtype):
    """gemm.c: bfloat16 weights times bfloat16 or float32 activations, summed in float32, one fixed order per
    output whatever the number of rows or threads; outputs not a multiple of its blocks (4 weight rows, 32 on the
    tile unit, which bfloat16 activations take on a CPU with AMX) and a bias; up to 16 and over 16 rows (one or
    two tiles of activations)."""
    from utils.lean import native

    if not _our_kernels_run_here():  # its absence checked: skipped with the reason (failed under SPECDEC_REQUIRE_NATIVE=1)
        require_native()
    torch.manual_seed(0)
    weight, bias = torch.randn(37, 96).to(torch.bfloat16), torch.randn(37).to(x_dtype)
    x = torch.randn(native.MAX_ROWS, 96).to(x_dtype)
    assert native.supports((37, 96), torch.bfloat16) and not native.supports((37, 96), torch.float32)
    full = native.gemm(x, weight, bias)
    exact = x.double() @ weight.double().T + bias.double()
    # float32 sums of exact products; a bfloat16 result is rounded once (a relative half-ulp of 2^-9)
    tolerance = 1e-5 if x_dtype == torch.float32 else 2 ** -8
    assert full.dtype == x_dtype and torch.allclose(full.double(), exact, rtol=tolerance, atol=tolerance)
    for rows in range(1, native.MAX_ROWS):  # each tile of activations as wide as its rows
        assert torch.equal(native.gemm(x[:rows], weight, bias), full[:rows]), rows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.equal(native.gemm(x, weight, bias), full)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="at most 32 rows"):
        native.gemm(torch.randn(33, 96).to(x_dtype), weight, None)


def test_the_kernel_table_takes_our_kernel_only_as_a_whole_family(monkeypatch, tmp_path):
    """Width invariance across families: where our kernel is the invariant choice it is the choice at every row
    count (its bits differ from torch's); the table says which one is faster for each count."""
    from utils.lean import kernels, native

    if not _our_kernels_run_here():
        assert kernels.NATIVE not in kernels._candidates(1, (64, 96), torch.bfloat16)
        require_native()  # skipped with the reason (failed under SPECDEC_REQUIRE_NATIVE=1)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setenv(kernels.INVARIANT_ENV, "1")  # the invariant family whatever its price (the default weighs it)
    monkeypatch.setattr(kernels, "PROBE_BYTES", 1 << 20)
    kernels.kernel_table.cache_clear()
    table = kernels.kernel_table((64, 96), torch.bfloat16)
    assert kernels.NATIVE in kernels._candidates(1, (64, 96), torch.bfloat16) and table.invariant
    invariant = {table(rows) for rows in range(1, 33)}
    assert invariant == {kernels.NATIVE} or kernels.NATIVE not in invariant
    kernels.kernel_table.cache_clear()
    assert native.unavailable() is None


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bfloat16_weights_compute_in_float32_where_the_cpu_has_no_bfloat16_arithmetic(family, monkeypatch):
    """An AVX2-only CPU (said so here): a model held in bfloat16 computes in float32 in our own forward, its weights
    read in bfloat16 by our own kernel: the float32 model's logits (the same weight values) to float32 summation
    order; the model itself stays in bfloat16; greedy speculation equals plain greedy decoding."""
    import copy

    from sampling import autoregressive_generate, speculative_generate
    from utils.lean import native

    runs = _our_kernels_run_here()
    monkeypatch.setattr(native, "bfloat16_arithmetic", lambda: False)
    model = tiny_model(family, dtype=torch.bfloat16, attention="sdpa")
    as_float32 = copy.deepcopy(model).float()
    ids = prompt(1, 40)
    runner = StaticRunner(model, rows=1, slots=128)
    assert lean_decoder(model).dtype == (torch.float32 if runs else torch.bfloat16)  # without our kernel: bfloat16
    got = torch.cat([runner.forward_rows([(ids[a:b], None)], [b - a])[0] for a, b in ((0, 11), (11, 12), (12, 40))])
    if runs:  # float32 sums over the same weight values: the float32 model's logits
        assert got.dtype == torch.float32 and (got - _reference(as_float32, ids)).abs().max() < 1e-4
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    drafter = tiny_model(family, seed=1, dtype=torch.bfloat16, attention="sdpa")
    plain = autoregressive_generate(ids[:9], model, max_gen_len=24)
    for gamma in (2, 5):
        assert speculative_generate(ids[:9], drafter, model, gamma=gamma, max_gen_len=24)[0] == plain
    forget(model)


def test_greedy_speculation_over_gemma3s_mixed_layers_equals_transformers_greedy_decoding():
    """Gemma 3 mixes sliding and full layers (a window of 6): the runners take our forward for it all the same (a
    mask of each kind), and plain and speculative greedy decoding, one row or a batch, give transformers' tokens."""
    from sampling import autoregressive_generate, speculative_generate

    target, drafter = _extra_model("gemma3", "sdpa"), _extra_model("gemma3", "sdpa", seed=1)
    assert isinstance(make_runner(target, rows=2, max_tokens=40), StaticRunner)
    rows = [prompt(seed, 8 + 9 * seed) for seed in range(2)]
    references = []
    for ids in rows:
        with torch.no_grad():
            out = target.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, min_new_tokens=24)
        references.append(out[0, len(ids):].tolist())
        assert autoregressive_generate(ids, target, max_gen_len=24) == references[-1]
        for source, gamma in ((drafter, 1), (drafter, 3), (target, 8)):  # rejections and a whole block accepted
            assert speculative_generate(ids, source, target, gamma=gamma, max_gen_len=24)[0] == references[-1]
    assert [out for out, _ in speculative_generate(rows, drafter, target, gamma=3, max_gen_len=24)] == references


@pytest.mark.parametrize("group", [32, 64])
def test_our_four_bit_kernel_multiplies_the_quantized_weight_the_same_bits_at_every_width(group):
    """gemm.c's 4-bit product (llama.cpp's Q4_1 x Q8_1): the weight quantize_int4 makes (the same q, scales and
    minimums as torch's int4 form, a scale per 32 or 64 inputs), activations quantized to int8 per block of 32; within
    that rounding of the float product, the same bits at every row count; a prompt's many rows by the kernel in
    passes of 32 rows (the same bits again) or by the dequantized weight, as measured here."""
    from utils.lean import kernels, native
    from utils.quantize import _int4_groups, quantized_linear

    if not _our_kernels_run_here():
        assert quantized_linear(torch.nn.Linear(128, 48), 4, 32).kernel == "torch"
        require_native()  # skipped with the reason (failed under SPECDEC_REQUIRE_NATIVE=1)
    assert native.supports_q4(96, 32) and not native.supports_q4(80, 32)
    assert native.supports_q4(128, 64) and not native.supports_q4(96, 64) and not native.supports_q4(128, 128)
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 40, bias=True)
    layer = quantized_linear(linear, 4, group)
    assert layer.kernel == "native" and layer.weight_q.shape == (3, 4, 256)  # 40 rows in groups of 16, 4 blocks
    assert layer.scales.shape == (3, 128 // group, 2, 16) and native.q4_group(layer.weight_q, layer.scales) == group
    dequantized = native.dequantize_q4(layer.weight_q, layer.scales, 40)
    q, scales, minimums = _int4_groups(linear.weight, group)  # the same values as torch's steps: d * q, then + m
    expected = (q * scales.half().float() + minimums.half().float()).reshape(40, 128)
    assert torch.equal(dequantized, expected)
    assert torch.equal(native.dequantize_q4(layer.weight_q, layer.scales, 40, torch.bfloat16), expected.bfloat16())
    assert (dequantized - linear.weight).abs().max() < (linear.weight.abs().max() / 15)  # within half a step (+fp16)
    x = torch.randn(native.MAX_ROWS, 128)
    with torch.no_grad():
        full, exact = layer(x), x @ dequantized.T + linear.bias
        assert (full - exact).norm() / exact.norm() < 0.02  # the activations' int8 rounding
        for rows in (1, 3, 8, 13):
            assert torch.equal(layer(x[:rows]), full[:rows]), rows
        assert torch.allclose(layer(x.double()), full.double(), atol=1e-6)  # float64 in, float32 inside
        # A prompt's rows: by the kernel, 32 rows a call (each row its bits alone), or by the dequantized weight in
        # torch's GEMM (in bfloat16 where this CPU computes in it, else float32): the layer takes what was measured.
        prompt_rows = torch.randn(40, 128)
        in_pieces = native.gemm_q4(prompt_rows, layer.weight_q, layer.scales, 40, linear.bias, pieces=True)
        assert torch.equal(in_pieces, torch.cat([layer(row[None]) for row in prompt_rows]))
        dequantized_product = native.gemm_q4(prompt_rows, layer.weight_q, layer.scales, 40, linear.bias)
        tolerance = 2**-6 if native.bfloat16_arithmetic() else 1e-4
        exact_product = prompt_rows @ dequantized.T + linear.bias
        assert torch.allclose(dequantized_product, exact_product, atol=tolerance, rtol=tolerance)
        assert (in_pieces - exact_product).norm() / exact_product.norm() < 0.02
        chosen = in_pieces if kernels.q4_in_pieces(128, torch.float32) else dequantized_product
        assert torch.equal(layer(prompt_rows), chosen)


def test_a_four_bit_prompt_takes_the_kernel_in_pieces_where_it_costs_at_most_five_percent(monkeypatch, tmp_path):
    """`q4_in_pieces`: measured once per machine and input width (then read from the disk cache), the kernel where its
    passes of 32 rows cost at most 1.05x the dequantized weight's GEMM; SPECDEC_WIDTH_INVARIANT decides it when set."""
    from utils.lean import kernels

    require_native()
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.delenv(kernels.INVARIANT_ENV, raising=False)
    for pieces, dequantized, expected in ((1.0, 1.0, True), (1.04, 1.0, True), (1.2, 1.0, False)):
        kernels.q4_in_pieces.cache_clear()
        monkeypatch.setattr(kernels, "_measure_q4", lambda *_, p=pieces, d=dequantized: {"pieces": p, "dequantized": d})
        for f in (tmp_path / "kernels").glob("*.json"):
            f.unlink()
        assert kernels.q4_in_pieces(64, torch.bfloat16) is expected
        kernels.q4_in_pieces.cache_clear()
        monkeypatch.setattr(kernels, "_measure_q4", None)  # read from the disk now
        assert kernels.q4_in_pieces(64, torch.bfloat16) is expected
    for value, expected in (("1", True), ("0", False)):
        monkeypatch.setenv(kernels.INVARIANT_ENV, value)
        kernels.q4_in_pieces.cache_clear()
        assert kernels.q4_in_pieces(64, torch.bfloat16) is expected
    kernels.q4_in_pieces.cache_clear()
    monkeypatch.undo()  # the real measurement, on a small width
    seconds = kernels._measure_q4(64, torch.float32)
    assert set(seconds) == {"pieces", "dequantized"} and all(0 < t < 10 for t in seconds.values())


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3"])
def test_a_prompt_past_our_kernels_width_takes_torchs_causal_attention_and_the_models_logits(family, monkeypatch):
    """One row's prompt of more than 32 tokens from slot 0 (`PassSlots.causal`): torch's attention told it is causal
    (it skips the hidden half) where no window narrows the mask; the logits stay the Hugging Face model's (float64),
    and a window narrower than the prompt (Mistral's 8) keeps the mask."""
    from utils.lean import llama

    model = _model(family, "sdpa")
    ids = prompt(2, 48)
    seen = []
    sdpa = llama.F.scaled_dot_product_attention
    monkeypatch.setattr(llama.F, "scaled_dot_product_attention",
                        lambda *args, **kwargs: seen.append(kwargs.get("is_causal", False)) or sdpa(*args, **kwargs))
    logits = StaticRunner(model, rows=1, slots=64).forward_rows([(ids, None)], [48])[0]
    torch.testing.assert_close(logits, _reference(model, ids), rtol=TOLERANCE, atol=TOLERANCE)
    windowed = family == "mistral"  # its window of 8 narrows the mask: not the causal one
    assert seen and (not any(seen) if windowed else all(seen) if family == "llama" else any(seen))
