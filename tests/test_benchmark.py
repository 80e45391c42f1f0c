"""A CI-sized run of the Spec-Bench script on a tiny model and two prompts, so that it cannot rot."""

import json

from benchmarks import spec_bench
from tests.saved_model import save_tiny_chat_model


def test_benchmark_runs_end_to_end(tmp_path):
    model = save_tiny_chat_model(tmp_path / "model", max_positions=512)
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [
        {"question_id": 1, "category": "writing", "turns": ["w5 w6 w7 w8 w5 w6 w7"]},
        {"question_id": 2, "category": "summarization", "turns": ["w9 w10 w11 w9 w10 w11 w9"]},
    ]))
    out = tmp_path / "out"
    result = spec_bench.main(["--data", str(data), "--model", str(model), "--per-category", "1",
                              "--max-new-tokens", "12", "--out", str(out), "--quiet"])
    for name in ("results.json", "report.md", "speedup.png"):
        assert (out / name).stat().st_size > 0
    summary = result["summary"]
    assert set(summary) == set(spec_bench.METHODS)
    assert set(summary["ours_nasd"]["tasks"]) == {"multi-turn conversation", "summarization"}
    records = result["records"]
    assert len(records) == 2 * len(spec_bench.METHODS)
    # Our greedy methods reproduce transformers' greedy output token for token.
    assert all(r["matches_hf_greedy"] for r in records if r["method"].startswith("ours"))
    assert "goal" in result["report"]


def test_nasd_replay_estimates_a_speedup_on_copied_text():
    from benchmarks.nasd_replay import replay_one
    from ngram_assisted import MultiDynaGram
    from ngram_assisted.drafter import NgramDrafter

    text = [5, 6, 7, 8, 9] * 4  # the answer copies the prompt: drafts are accepted
    trace = {"task": "rag", "prompt": text, "generated": text, "top3": [[t, 3, 4] for t in text], "vocab": 96}
    assert replay_one(trace, NgramDrafter(MultiDynaGram(4), vocab_size=96), gamma=8) > 1.5
    novel = list(range(10, 30))  # nothing to copy: no draft, exactly the cost of plain decoding
    trace = {"task": "qa", "prompt": list(range(40, 60)), "generated": novel, "top3": [[t, 3, 4] for t in novel], "vocab": 96}
    assert replay_one(trace, NgramDrafter(MultiDynaGram(4), vocab_size=96), gamma=8) == 1.0
