"""The offline real models (`make models`): assembly and checksums, then greedy identity on
Qwen2.5-Coder-1.5B-Instruct against transformers' own greedy `generate`, for plain decoding,
speculative decoding with the 0.5B drafter and NASD. Marked `real_models`: `make test` deselects
them, `make test-models` (and CI, after `make test`) runs them. float32: a pass over several
tokens and one over a single token round alike to the last bits often enough that 24 tokens on a
few prompts match exactly (bfloat16 would make near-ties, see the README)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.prompts import encode, load_humaneval, load_workload
from ngram_assisted import MultiDynaGram, ngram_assisted_speculative_generate
from sampling import SpeculativeStats, autoregressive_generate, speculative_generate
from tests import conftest
from utils.loading import end_token_ids, load_model
from utils.offline_models import OFFLINE_MODELS, assemble

pytestmark = pytest.mark.real_models
TARGET, DRAFTER = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
NEW_TOKENS = 24


@pytest.fixture(scope="module", autouse=True)
def user_cache():
    """The user's cache, where the de-quantized models live (converted once, like `make chat`)."""
    with pytest.MonkeyPatch.context() as patch:
        if conftest.USER_CACHE is None:
            patch.delenv("SPECDEC_CACHE")
        else:
            patch.setenv("SPECDEC_CACHE", conftest.USER_CACHE)
        yield


@pytest.mark.parametrize("name", [name for name, model in OFFLINE_MODELS.items() if model.sha256])
def test_the_parts_assemble_to_the_recorded_checksum(name, tmp_path):
    model = OFFLINE_MODELS[name]
    if not model.installed():
        pytest.fail(f"{name} is not installed: run make models before the real-model tests")
    out = assemble(model, tmp_path)  # raises on a checksum mismatch
    assert out.stat().st_size == model.size_bytes


@pytest.fixture(scope="module")
def pair():
    target, tokenizer = load_model(TARGET, dtype="float32")
    drafter, drafter_tokenizer = load_model(DRAFTER, dtype="float32")
    assert drafter_tokenizer.get_vocab() == tokenizer.get_vocab()  # the 0.5B drafts for the 1.5B as is
    return target, drafter, tokenizer


@pytest.fixture(scope="module")
def prompts(pair):
    _, _, tokenizer = pair
    texts = [text for _, text in load_humaneval(2)] + [text for _, text in load_workload("spec_bench", 1)[:1]]
    return [encode(tokenizer, text) for text in texts]


def transformers_greedy(model, ids: list[int], end: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=new_tokens, do_sample=False, eos_token_id=end, pad_token_id=end[0])
    return out[0, len(ids):].tolist()


def test_greedy_identity_on_the_1_5b(pair, prompts):
    target, drafter, tokenizer = pair
    end = end_token_ids(target, tokenizer)
    common = dict(max_gen_len=NEW_TOKENS, end_tokens_id=end)
    accepted = 0
    for ids in prompts:
        reference = transformers_greedy(target, ids, end)
        assert len(reference) == NEW_TOKENS
        assert autoregressive_generate(ids, target, **common) == reference
        stats = SpeculativeStats()
        out, _ = speculative_generate(ids, drafter, target, gamma=4, stats=stats, **common)
        assert out == reference
        accepted += stats.drafts_accepted
        out, _ = ngram_assisted_speculative_generate(ids, MultiDynaGram(8), target, **common)
        assert out == reference
    assert accepted > 0  # the real drafter's drafts are accepted: identity is not reached by rejecting all


def test_the_other_families_load_and_decode():
    model, tokenizer = load_model("gemma-3-270m", dtype="float32")
    assert len(tokenizer) >= 262_000
    ids = tokenizer("def add(a, b):")["input_ids"]
    end = end_token_ids(model, tokenizer)
    assert autoregressive_generate(ids, model, max_gen_len=8, end_tokens_id=end) == transformers_greedy(model, ids, end, 8)
