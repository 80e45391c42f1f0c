"""`python -m benchmarks`: the list names every benchmark, each one's --help exits 0 through it, and the benchmarks no
other test runs end to end run here on the tiny saved model (spec_bench, throughput, evaluate, nasd_tau,
suffix_compare, conversations, self_tau: tests/test_benchmark.py; coupling_acceptance:
tests/test_coupling_acceptance.py; peers without llama.cpp: tests/test_peers.py; first_token here, its by-path
comparison too; busy here). Benchmarks of the real models or the peers get the --help check only."""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import __main__ as command
from tests.saved_model import save_tiny_chat_model

ROOT = Path(__file__).resolve().parent.parent
# Found by their text, not by the command's own rule: a module run as a script is a benchmark.
ENTRY_POINTS = sorted(path.stem for path in (ROOT / "benchmarks").glob("*.py")
                      if path.stem != "__main__" and 'if __name__ == "__main__":' in path.read_text())


def test_the_list_names_every_benchmark_with_its_docstring_s_first_sentence(capsys):
    assert len(ENTRY_POINTS) >= 14 and {"spec_bench", "pld_tau", "passes", "conversations"} <= set(ENTRY_POINTS)
    assert list(command.benchmarks()) == ENTRY_POINTS
    command.main([])
    text = capsys.readouterr().out
    assert text.startswith("usage: python -m benchmarks NAME")
    listed = [line.split()[0] for line in text.splitlines() if line.startswith("  ") and not line.startswith("   ")]
    assert listed == ENTRY_POINTS
    words = " ".join(text.split())
    for name in ENTRY_POINTS:
        doc = importlib.import_module(f"benchmarks.{name}").__doc__
        first = " ".join(doc.strip().split("\n\n")[0].split())
        assert f"{name} {first}" in words  # wrapped to the terminal: compare words
    command.main(["--help"])
    assert capsys.readouterr().out == text


def test_an_unknown_name_is_refused_with_the_list(capsys):
    with pytest.raises(SystemExit) as exit_:
        command.main(["spec-bench"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "no benchmark named 'spec-bench'" in err and "spec_bench" in err


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_every_benchmark_s_help_exits_0_through_the_command(name, capsys):
    module = importlib.import_module(f"benchmarks.{name}")
    (argv,) = inspect.signature(module.main).parameters.values()
    assert argv.name == "argv" and argv.default is None  # main(argv: list[str] | None = None)
    program = sys.argv[0]
    with pytest.raises(SystemExit) as exit_:
        command.main([name, "--help"])
    assert exit_.value.code == 0 and sys.argv[0] == program
    text = capsys.readouterr().out
    assert text.startswith(f"usage: python -m benchmarks {name} ")  # the command as typed
    assert " ".join(module.__doc__.split()[:6]) in " ".join(text.split())


def test_nasd_replay_s_commands_each_have_their_help(capsys):
    for subcommand in ("record", "replay", "compare"):
        with pytest.raises(SystemExit) as exit_:
            command.main(["nasd_replay", subcommand, "--help"])
        assert exit_.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: python -m benchmarks nasd_replay {subcommand} ")


def test_pld_tau_takes_the_shared_flags(capsys):
    from benchmarks import cli

    with pytest.raises(SystemExit):
        command.main(["pld_tau", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--target MODEL, --model MODEL" in text and " ".join(cli.TARGET_HELP.split()) in text
    assert "--dtype DTYPE" in text and "--temperature TEMPERATURE" in text and "--top-p TOP_P" in text
    with pytest.raises(SystemExit) as exit_:
        command.main(["pld_tau", "--max-new-tokens", "0"])  # refused before any model loads
    assert exit_.value.code == 2 and "--max-new-tokens must be >= 1" in capsys.readouterr().err


@pytest.mark.subprocess
def test_python_dash_m_benchmarks_lists_and_refuses_without_loading_torch():
    listed = subprocess.run([sys.executable, "-m", "benchmarks"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and all(f"  {name} " in listed.stdout for name in ENTRY_POINTS)
    unknown = subprocess.run([sys.executable, "-m", "benchmarks", "nope"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
    assert unknown.returncode == 2 and "no benchmark named 'nope'" in unknown.stderr
    imports = subprocess.run([sys.executable, "-c", "import sys, benchmarks.__main__ as m; m.listing(); "
                              "print('torch' in sys.modules)"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert imports.stdout.strip() == "False"  # the list reads the files: it starts at once


@pytest.fixture
def tiny_model(tmp_path, monkeypatch) -> str:
    """The tiny saved chat model (vocab 300: `passes` caches 256 distinct tokens), pass costs from the prior."""
    monkeypatch.setenv("SPECDEC_CALIBRATE", "0")
    return str(save_tiny_chat_model(tmp_path / "model", vocab=300, max_positions=1024))


def test_pld_tau_runs_greedy_and_sampled_on_a_tiny_model(tiny_model, capsys):
    command.main(["pld_tau", "--model", tiny_model, "--prompts", "2", "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert "hf_pld  mean tau" in out and "prompts 2, NASD's output differs from PLD's in 0" in out
    command.main(["pld_tau", "--model", tiny_model, "--prompts", "1", "--max-new-tokens", "8", "--sample"])
    out = capsys.readouterr().out
    assert "hf_pld" not in out and "prompts 1, NASD's output differs from PLD's in 0" in out  # seeded: the same tokens


def test_nasd_replay_records_replays_and_compares_on_a_tiny_model(tiny_model, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) for i, (c, t) in
                              enumerate([("writing", "w5 w6 w7 w8 w5 w6 w7"), ("qa", "w9 w10 w11 w9 w10 w11")])))
    traces = tmp_path / "traces.json"
    command.main(["nasd_replay", "record", "--data", str(data), "--per-category", "1", "--offset", "0",
                  "--max-new-tokens", "8", "--out", str(traces), "--model", tiny_model])
    recorded = json.loads(traces.read_text())
    assert len(recorded["traces"]) == 2 and all(len(t["generated"]) == len(t["top3"]) > 0 for t in recorded["traces"])
    for argv in (["replay"], ["replay", "--drafter", "suffix"], ["compare"]):
        command.main(["nasd_replay", *argv, "--traces", str(traces)])
    assert capsys.readouterr().out.count("| geomean ") == 2


def test_suffix_decoding_says_whether_its_peer_is_built(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    command.main(["suffix_decoding"])  # no --build: nothing fetched
    assert "SuffixDecoding peer: SuffixDecoding is not built here" in capsys.readouterr().out


def test_draft_cost_prints_the_cost_table_on_a_tiny_model(tiny_model, monkeypatch, capsys):
    from benchmarks import draft_cost

    monkeypatch.setattr(draft_cost, "copy_bandwidth", functools.partial(draft_cost.copy_bandwidth, megabytes=16))
    command.main(["draft_cost", "--model", tiny_model, "--repeats", "1"])
    out = " ".join(capsys.readouterr().out.split())
    assert "cost of 1 + k tokens" in out and "calibration key" in out and "memory bound of plain decoding" in out


def test_passes_writes_every_model_s_passes_on_a_tiny_model(tiny_model, tmp_path, monkeypatch):
    from benchmarks import passes
    from utils.lean import layer_ops, native

    for module, name in [*((native, name) for name in ("gemm", "gemm_q4")),
                         *((layer_ops, name) for name in ("rms_norm", "add_rms_norm", "rope_write", "attention"))]:
        monkeypatch.setattr(module, name, getattr(module, name))  # main wraps them for the profiler: unwrapped after
    monkeypatch.setattr(passes, "read_bandwidth", functools.partial(passes.read_bandwidth, gigabytes=0.03))
    out = tmp_path / "passes"
    command.main(["passes", "--model", tiny_model, "--drafter", tiny_model, "--prompts", "1", "--repeats", "1",
                  "--max-new-tokens", "4", "--context", "40", "--out", str(out)])
    result = json.loads((out / "results.json").read_text())
    assert [report["model"] for report in result["passes"]] == ["target", "drafter", "self-drafter (int4)"]
    assert result["context"] == 40 and all(report["cache_gb"] > 0 for report in result["passes"])
    assert all(set(report["widths"]) == {str(w) for w in passes.WIDTHS} for report in result["passes"])
    assert result["plain_decoding"]["outputs"] and not result["emulated_avx2"]


def test_first_token_writes_its_passes_peaks_and_the_by_path_comparison_on_a_tiny_model(tiny_model, tmp_path, capsys):
    out = tmp_path / "first_token"
    command.main(["first_token", "--model", tiny_model, "--path", tiny_model, "--lengths", "8,2000", "--repeats", "2",
                  "--gemm-size", "64", "--max-new-tokens", "4", "--out", str(out)])
    result = json.loads((out / "first_token.json").read_text())
    first = result["first_token"]
    assert [row["tokens"] for row in first["lengths"]] == [8, 1023]  # 2000 capped at the context (1024) less one
    assert set(first["peak_flop_per_s"]) == {"bfloat16", "float32"} and first["dtype"] == "torch.float32"
    for row in first["lengths"]:
        assert row["outputs"] == {"defects": 0, "near_ties": 0} and row["first_tokens"]["ours"] == row["first_tokens"]["transformers"]
        assert row["flops"] > 0 and set(row["of_peak"]) == {"ours", "transformers"} and row["ours_speedup"] > 0
    path = result["by_path"]
    assert path["path"]["dtype"] == path["name"]["dtype"] and path["same_tokens"] and path["path_over_name"] > 0
    assert result["machine"]["cpu"] and "| 1023 |" in (out / "first_token.md").read_text()
    # a float32 model's prompt takes torch's attention (ours is bfloat16's), and the report says so
    assert first["prompt_attention"].startswith("torch's") and "a prompt's attention: torch's" in (out / "first_token.md").read_text()
    assert "time to the first token" in capsys.readouterr().out


def test_busy_runs_each_condition_and_checks_every_output_on_a_tiny_model(tiny_model, tmp_path, monkeypatch, capsys):
    from benchmarks import busy

    monkeypatch.setattr(busy, "SETTLE_SECONDS", 0.0)
    monkeypatch.setattr(busy, "BUSY_LOOP", "import time; time.sleep(60)")  # the flow, without taking a core from the suite
    out = tmp_path / "busy"
    command.main(["busy", "--model", tiny_model, "--max-new-tokens", "3", "--repeats", "1", "--out", str(out)])
    result = json.loads((out / "busy.json").read_text())
    assert [r["condition"] for r in result["records"]] == list(busy.CONDITIONS)
    assert not any(r["differs"] for r in result["records"]) and all(r["tokens"] == 3 for r in result["records"])
    assert set(result["summary"]["ratios"]) == {"busy / quiet, fair share", "busy / quiet, without",
                                                "quiet: fair share / without",
                                                "busy with the fair share / quiet on one thread"}
    assert "busy / quiet with the fair share" in capsys.readouterr().out


def test_first_token_refuses_bad_lengths_before_loading(capsys):
    with pytest.raises(SystemExit) as exit_:
        command.main(["first_token", "--lengths", "512,x"])
    assert exit_.value.code == 2 and "--lengths must be positive integers" in capsys.readouterr().err
