"""The llama.cpp peer benchmark (benchmarks/peers.py) without llama.cpp: the skip path on a tiny model, the table
built with a fake peer of the same small interface, the ratios and agreements from given timings and outputs, and
the drafter-model hook (`ModelDraft`) on a fake `Llama`. The real peer (make peers) is not needed here."""

import ctypes
import json
import sys
import types

import numpy as np
import pytest

from benchmarks import llama_peer, peers
from sampling import autoregressive_generate
from tests.saved_model import save_tiny_chat_model


def write_prompts(folder):
    data = folder / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [
        {"question_id": 1, "category": "writing", "turns": ["w5 w6 w7 w8 w5 w6 w7"]},
        {"question_id": 2, "category": "summarization", "turns": ["w9 w10 w11 w9 w10 w11 w9"]},
    ]))
    return data


def run(tmp_path, *extra):
    model = save_tiny_chat_model(tmp_path / "model", max_positions=512)
    argv = ["--workload", "spec_bench", "--data", str(write_prompts(tmp_path)), "--target", str(model),
            "--per-category", "1", "--repeats", "2", "--max-new-tokens", "10", "--out", str(tmp_path / "out"), *extra]
    return peers.main(argv)


def test_without_llama_cpp_the_peer_is_skipped_in_one_line_and_ours_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as in CI: not installed
    result = run(tmp_path)
    assert not result["peer"] and len(result["notes"]) == 1
    assert result["notes"][0].startswith("llama.cpp skipped: llama-cpp-python is not installed")
    assert "make peers" in capsys.readouterr().out
    assert set(result["summary"]) == {"ours_ar", "ours_nasd"}
    assert len(result["records"]) == 2 * 2 * 2  # prompts x repeats x methods
    assert all(r["identical"] and r["difference"] is None for r in result["records"])  # float32: NASD keeps greedy's
    assert "llama.cpp did not run" in result["report"]
    written = json.loads((tmp_path / "out" / "results.json").read_text())
    assert written["settings"]["weights"]["ours"] == "float32" and written["notes"] == result["notes"]


def test_a_target_with_no_gguf_file_skips_the_peer_even_with_the_binding(tmp_path, monkeypatch):
    binding = types.ModuleType("llama_cpp")
    binding.llama_speculative = types.ModuleType("llama_cpp.llama_speculative")
    monkeypatch.setitem(sys.modules, "llama_cpp", binding)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", binding.llama_speculative)
    peer, why = llama_peer.load_peer(str(tmp_path), None, n_ctx=256, threads=1)
    assert peer is None and why.startswith("llama.cpp skipped: ") and "has no GGUF file" in why and "\n" not in why


class FakePeer:
    """llama.cpp's interface: plain decoding on other weights (its output parts from ours at token 3), and a
    prompt lookup that returns its plain output."""

    methods = ("llama_plain", "llama_prompt_lookup")
    weights = "GGUF Q4_K_M: Q4_K 100%"

    def __init__(self, model) -> None:
        self.model, self.calls = model, []

    def generate(self, method, ids, max_new_tokens, end_tokens):
        self.calls.append(method)
        out = autoregressive_generate(ids, self.model, max_gen_len=max_new_tokens, end_tokens_id=end_tokens)
        return out[:3] + [(out[3] + 1) % 96] + out[4:]


def test_with_a_fake_peer_the_table_holds_both_sides(tmp_path, monkeypatch):
    fakes = []

    def load(target, drafter, **settings):
        from utils.loading import load_model

        assert settings["n_ctx"] > 10 and settings["threads"] >= 1
        fakes.append(FakePeer(load_model(target)[0]))
        return fakes[0], ""

    monkeypatch.setattr(peers, "load_peer", load)
    result = run(tmp_path)
    summary = result["summary"]
    assert set(summary) == {"ours_ar", "ours_nasd", "llama_plain", "llama_prompt_lookup"}
    assert fakes[0].calls.count("llama_plain") == 1 + 2 * 2  # the warm-up, then prompts x repeats
    plain = summary["llama_plain"]
    assert plain["agreement_with_ours"]["equal"] == 0 and plain["agreement_with_ours"]["first_divergence_median"] == 3
    assert plain["agreement_with_ours"]["identical"] == pytest.approx(9 / 10)  # 10 tokens, one differs
    assert summary["llama_prompt_lookup"]["identical"] == 4 and summary["ours_nasd"]["identical"] == 4
    for row in summary.values():
        assert row["vs_llama_plain"] == pytest.approx(row["tokens_per_s"] / plain["tokens_per_s"])
        assert row["vs_ours_plain"] == pytest.approx(row["tokens_per_s"] / summary["ours_ar"]["tokens_per_s"])
    report = result["report"]
    assert "| llama_prompt_lookup | GGUF Q4_K_M: Q4_K 100% |" in report and "| ours_nasd | float32 |" in report
    assert "vs ours plain: 90% identical tokens, 0/4 equal, first divergence at token 3 (median)" in report
    assert "best of ours (" in report and ") / best of llama.cpp (" in report
    assert "4/4 = llama.cpp plain" in report and "4/4 = ours plain (0 defects, 0 near-ties), tau " in report
    assert summary["ours_nasd"]["tau"] >= 1 and "tau" not in summary["ours_ar"]  # tokens per step: why it is as fast
    assert "- llama.cpp's prompt lookup: LlamaPromptLookupDecoding{'max_ngram_size': 2, 'num_pred_tokens': 10}" in report


def record(method, tokens, seconds, output, prompt=0, repeat=0):
    side = "llama.cpp" if method.startswith("llama") else "ours"
    return {"method": method, "side": side, "prompt": prompt, "repeat": repeat, "tokens": tokens, "seconds": seconds,
            "output": output}


def test_the_ratios_are_those_of_the_given_timings_medians():
    same, other = [1, 2, 3, 4], [1, 2, 9, 4]
    records = []
    for repeat, (ours_s, nasd_s, plain_s, lookup_s) in enumerate([(2.0, 1.0, 1.0, 0.5), (4.0, 1.0, 2.0, 0.5),
                                                                   (1.0, 0.25, 0.4, 0.4)]):
        records += [record("ours_ar", 4, ours_s, same, repeat=repeat), record("ours_nasd", 4, nasd_s, same, repeat=repeat),
                    record("llama_plain", 4, plain_s, other, repeat=repeat),
                    record("llama_prompt_lookup", 4, lookup_s, other if repeat else same, repeat=repeat)]
    peers.check_outputs(records, {0: [7, 7]}, classify=lambda *a: pytest.fail("identical outputs need no weighing"))
    methods = ["ours_ar", "ours_nasd", "llama_plain", "llama_prompt_lookup"]
    summary = peers.summarise(records, methods)
    # tokens/s: ours_ar 2, 1, 4 -> 2; ours_nasd 4, 4, 16 -> 4; llama_plain 4, 2, 10 -> 4; lookup 8, 8, 10 -> 8
    assert [summary[m]["tokens_per_s"] for m in methods] == [2.0, 4.0, 4.0, 8.0]
    assert summary["ours_nasd"]["vs_llama_plain"] == 1.0 and summary["ours_nasd"]["vs_ours_plain"] == 2.0
    assert summary["llama_prompt_lookup"]["vs_ours_plain"] == 4.0 and summary["ours_ar"]["vs_llama_plain"] == 0.5
    assert summary["llama_plain"]["min"] == 2.0 and summary["llama_plain"]["max"] == 10.0
    lookup = summary["llama_prompt_lookup"]  # equal to llama.cpp's plain twice, once its 3 of 4 tokens
    assert lookup["identical"] == 2 and lookup["agreement"] == pytest.approx((1 + 1 + 0.75) / 3)
    assert summary["llama_plain"]["agreement_with_ours"] == {"identical": 0.75, "equal": 0, "first_divergence_median": 2}
    rows = peers.table_rows(summary, {"ours": "bfloat16", "llama.cpp": "GGUF Q8_0"})
    assert rows[1] == ["ours_nasd", "bfloat16", "4.00 [4.00-16.00]", "1.00x", "2.00x", "3/3 = ours plain (0 defects, 0 near-ties)"]
    assert rows[3][-1] == "2/3 = llama.cpp plain, 92% identical tokens"
    assert peers.goal_line(summary).endswith("= 0.50x")  # ours_nasd 4 against llama_prompt_lookup 8


def test_agreement_is_the_share_of_identical_positions_and_the_first_divergence():
    assert peers.agreement([1, 2, 3, 4], [1, 2, 9, 4]) == {"identical": 0.75, "first_divergence": 2}
    assert peers.agreement([1, 2], [1, 2, 3]) == {"identical": 2 / 3, "first_divergence": 2}  # one stopped earlier
    assert peers.agreement([5, 6], [5, 6]) == {"identical": 1.0, "first_divergence": None}


class FakeLlama:
    """What `ModelDraft` uses of a `Llama`: `input_ids`, `n_tokens`, `eval`, `n_vocab`, `_ctx.get_logits_ith`. Its
    next token after t is t + 1 (mod 8), with logit `peak` (the others 0)."""

    def __init__(self, peak: float = 10.0) -> None:
        self.input_ids, self.n_tokens, self.fed, self.peak, self._ctx = np.zeros(64, dtype=np.intc), 0, [], peak, self

    def n_vocab(self) -> int:
        return 8

    def eval(self, tokens) -> None:
        self.fed.append(list(tokens))
        self.input_ids[self.n_tokens : self.n_tokens + len(tokens)] = tokens
        self.n_tokens += len(tokens)

    def get_logits_ith(self, i):
        assert i == -1
        logits = [0.0] * 8
        logits[(int(self.input_ids[self.n_tokens - 1]) + 1) % 8] = self.peak
        self._buffer = (ctypes.c_float * 8)(*logits)
        return ctypes.cast(self._buffer, ctypes.POINTER(ctypes.c_float))


def test_the_drafter_hook_drafts_greedily_and_feeds_only_what_its_cache_lacks():
    drafter = FakeLlama()
    draft = llama_peer.ModelDraft(drafter, n_max=3)
    assert draft(np.array([1, 2, 3], dtype=np.intc)).tolist() == [4, 5, 6]
    assert drafter.fed == [[1, 2, 3], [4], [5]]  # the last draft is not fed: nothing drafts after it
    assert draft(np.array([1, 2, 3, 4, 7], dtype=np.intc)).tolist() == [0, 1, 2]  # 4 accepted, 7 the target's
    assert drafter.fed[3:] == [[7], [0], [1]]  # the cached prefix 1 2 3 4 is kept
    assert draft(np.array([1, 2, 3, 4, 7], dtype=np.intc)).tolist() == [0, 1, 2]  # all cached: the last id is fed again
    assert drafter.fed[6] == [7]


def test_the_drafter_hook_stops_below_p_min_and_refuses_no_draft():
    unsure = FakeLlama(peak=1.0)  # p = e / (e + 7) ~ 0.28
    assert llama_peer.ModelDraft(unsure, n_max=3, p_min=0.5)(np.array([1, 2], dtype=np.intc)).tolist() == []
    assert llama_peer.ModelDraft(FakeLlama(peak=1.0), n_max=2, p_min=0.25)(np.array([1], dtype=np.intc)).tolist() == [2, 3]
    with pytest.raises(ValueError, match="n_max must be >= 1, got 0"):
        llama_peer.ModelDraft(unsure, n_max=0)


class FakeBinding(types.ModuleType):
    """llama_cpp as `LlamaCppPeer` uses it: `Llama(**settings)` whose `generate` yields 10, 11, 12, ... greedily,
    and `llama_speculative.LlamaPromptLookupDecoding`."""

    def __init__(self, fails: bool = False) -> None:
        super().__init__("llama_cpp")
        self.made, binding = [], self
        self.llama_speculative = types.SimpleNamespace(LlamaPromptLookupDecoding=lambda **kw: ("lookup", kw))

        class Llama:
            def __init__(self, **settings) -> None:
                if fails:
                    raise ValueError(f"Failed to load model from file: {settings['model_path']}")
                self.settings, self.n_tokens = settings, 7  # a previous run's cache
                binding.made.append(self)

            def reset(self) -> None:
                self.n_tokens = 0

            def generate(self, tokens, **sampling):
                assert sampling == llama_peer.GREEDY and self.n_tokens == 0  # greedy, from an empty cache
                yield from range(10, 10 + 1000)

        self.Llama = Llama


def test_the_peer_runs_each_method_greedily_from_an_empty_cache_and_stops_at_an_end_token():
    binding, gguf = FakeBinding(), llama_peer.gguf_file(None)  # the built-in model's GGUF file (make setup)
    peer = llama_peer.LlamaCppPeer(binding, gguf, gguf, n_ctx=300, threads=2, draft_max=5)
    assert peer.methods == ("llama_plain", "llama_prompt_lookup", "llama_draft")
    assert peer.weights.startswith("GGUF Q4_1: Q4_1 ") and "Q8_0" in peer.weights  # read from the file
    plain, lookup, small, draft = binding.made
    assert plain.settings == {"model_path": str(gguf), "n_ctx": 300, "n_threads": 2, "n_threads_batch": 2, "verbose": False}
    assert lookup.settings["draft_model"] == ("lookup", llama_peer.PROMPT_LOOKUP)
    assert draft.settings["draft_model"].drafter is small and draft.settings["draft_model"].n_max == 5
    assert peer.generate("llama_plain", [1, 2], max_new_tokens=5, end_tokens=[12]) == [10, 11, 12]
    assert peer.generate("llama_draft", [1, 2], max_new_tokens=4, end_tokens=[]) == [10, 11, 12, 13]


def test_a_model_the_binding_cannot_load_skips_the_peer_in_one_line(monkeypatch):
    binding = FakeBinding(fails=True)
    monkeypatch.setitem(sys.modules, "llama_cpp", binding)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", binding.llama_speculative)
    peer, why = llama_peer.load_peer(None, None, n_ctx=256, threads=1, probe=lambda path: "")
    assert peer is None and why.startswith("llama.cpp skipped: ") and "did not load (Failed to load model" in why
    crashing = lambda path: f"a first decode of {path.name} ended with signal 11"  # noqa: E731
    peer, why = llama_peer.load_peer(None, None, n_ctx=256, threads=1, probe=crashing)
    assert peer is None and why == "llama.cpp skipped: a first decode of SmolLM2-135M-Instruct.Q4_1.gguf ended with signal 11"


def test_the_probe_says_in_one_line_how_a_first_decode_ended(tmp_path):
    (tmp_path / "other.bin").write_bytes(b"not a gguf file")
    why = llama_peer.decodes(tmp_path / "other.bin")  # no binding (CI) or no model in the file: exit status 1
    assert why.startswith("a first decode of other.bin ended with exit status 1: ") and "\n" not in why


def test_the_weight_format_is_read_from_the_gguf_header(tmp_path):
    from gguf import GGUFWriter, LlamaFileType

    from benchmarks.gguf_types import weight_types

    writer = GGUFWriter(tmp_path / "tiny.gguf", "llama")
    writer.add_file_type(LlamaFileType.MOSTLY_F16)
    writer.add_token_list(["<s>", "a", "bc"])  # an array of strings, skipped
    writer.add_token_scores([0.0, -1.0, -2.0])  # an array of numbers, skipped
    writer.add_tensor("big", np.zeros((4, 6), dtype=np.float16))
    writer.add_tensor("small", np.zeros(8, dtype=np.float32))
    writer.add_tensor("tiny", np.zeros(1, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert weight_types(tmp_path / "tiny.gguf") == "GGUF F16: F16 73%, F32 27%"  # 24 of 33 parameters, then 9
    (tmp_path / "other.bin").write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        weight_types(tmp_path / "other.bin")


def test_no_prompts_and_a_bad_draft_length_are_refused_before_any_model_loads(tmp_path):
    with pytest.raises(SystemExit, match="no prompts: --per-category 0 of workload humaneval"):
        peers.main(["--target", str(tmp_path / "absent"), "--per-category", "0"])
    with pytest.raises(SystemExit) as refused:
        peers.main(["--llama-draft-max", "0"])
    assert refused.value.code == 2
