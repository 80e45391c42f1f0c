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
