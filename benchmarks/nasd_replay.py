"""Tune NASD's drafting policy offline: record greedy outputs once, replay the drafter in seconds.

    python -m benchmarks.nasd_replay record --per-category 3 --out nasd_traces.json   # ~5 min
    python -m benchmarks.nasd_replay replay --traces nasd_traces.json                 # ~10 s

`record` decodes held-out Spec-Bench prompts (taken from the end of the file, so that they differ
from the benchmark's, which come from the start) greedily and stores each output with the target's
top-3 tokens and their probabilities at every position. `replay` runs the real `NgramDrafter`
against those traces: in greedy mode a draft is accepted iff it equals the recorded token, so the
replay is exact, and its speedup estimate is tokens / sum(cost of each verification pass) under
the prior cost table. Off the accepted path the trace has no scores, so recycling learns less than
in a real run. It ignores Python overhead and noise: use it to compare policies, then confirm with
`nasd_tau` (tau from real passes) and spec_bench.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.spec_bench import DEFAULT_DATA, encode, load_prompts
from ngram_assisted import MultiDynaGram, SimpleDynaGram
from ngram_assisted.drafter import NgramDrafter
from utils.cost_model import prior_cost


def record(data: Path, per_category: int, max_new_tokens: int, out: Path, model_name: str | None) -> None:
    from sampling import autoregressive_generate
    from utils.loading import end_token_ids, load_model

    model, tokenizer = load_model(model_name)
    end = end_token_ids(model, tokenizer)
    traces = []
    for task, text in load_prompts(data, per_category, held_out=True):
        prompt = encode(tokenizer, text)
        generated = autoregressive_generate(prompt, model, max_gen_len=max_new_tokens, end_tokens_id=end)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1]
        top3 = logits.float().softmax(dim=-1).topk(3, dim=-1)
        traces.append({"task": task, "prompt": prompt, "generated": generated, "top3": top3.indices.tolist(),
                       "top3_p": top3.values.tolist(), "vocab": logits.shape[-1]})
    out.write_text(json.dumps(traces))


def stand_in_logits(trace: dict, position: int, path: list[int], num_nodes: int) -> torch.Tensor:
    """The verification pass's logits as far as the trace knows them: on the accepted path, the
    recorded top-3 probabilities (the rest of the mass spread evenly); off the path, where the trace
    has no scores, -inf everywhere (a row the drafter cannot learn from)."""
    rows = torch.full((1 + num_nodes, trace["vocab"]), -torch.inf)
    recorded = trace.get("top3_p")  # traces recorded before probabilities were: a stand-in
    for row, node in enumerate([-1, *path]):
        tokens = trace["top3"][position + row]
        probabilities = torch.tensor(recorded[position + row] if recorded else [0.5, 0.3, 0.1])
        rest = (1 - probabilities.sum()).clamp(min=1e-6) / (trace["vocab"] - 3)
        rows[1 + node] = rest.log()
        rows[1 + node, tokens] = probabilities.log()
    return rows


def replay_one(trace: dict, drafter: NgramDrafter, gamma: int) -> float:
    """Estimated speedup of NASD over plain decoding on one recorded greedy trace."""
    sequence, generated = list(trace["prompt"]), trace["generated"]
    drafter.start(sequence)
    position, cost = 0, 0.0
    while position < len(generated):
        tree, _ = drafter.draft(sequence, gamma, len(generated) - position - 1)
        path, node = [], -1  # greedy acceptance of the tree against the recorded output
        while position + len(path) < len(generated):
            wanted = generated[position + len(path)]
            node = next((i for i, parent in enumerate(tree.parents) if parent == node and tree.tokens[i] == wanted), None)
            if node is None:
                break
            path.append(node)
        n = len(path)
        sequence += generated[position : position + n + 1]
        drafter.update(sequence, path, stand_in_logits(trace, position, path, len(tree)), None)
        cost += prior_cost(len(tree))
        position += n + 1
    return len(generated) / cost


def replay(traces_path: Path, pool: str, n: int, gamma: int, top_k_filler: int, stop_if_unknown: bool,
           branching: int = 1) -> dict:
    traces = json.loads(traces_path.read_text())
    by_task: dict[str, list[float]] = defaultdict(list)
    for trace in traces:
        ngram = (MultiDynaGram if pool == "multi" else SimpleDynaGram)(n)
        drafter = NgramDrafter(ngram, vocab_size=trace["vocab"], top_k_filler=top_k_filler,
                               stop_if_unknown=stop_if_unknown, branching=branching)
        by_task[trace["task"]].append(replay_one(trace, drafter, gamma))
    speedups = {task: statistics.fmean(values) for task, values in by_task.items()}
    overall = math.exp(statistics.fmean(math.log(v) for v in speedups.values()))
    print(" ".join(f"{task}={value:.2f}" for task, value in speedups.items()) + f" | overall {overall:.3f}")
    return speedups


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record")
    rec.add_argument("--data", type=Path, default=DEFAULT_DATA)
    rec.add_argument("--per-category", type=int, default=3)
    rec.add_argument("--max-new-tokens", type=int, default=128)
    rec.add_argument("--model", default=None)
    rec.add_argument("--out", type=Path, default=Path("nasd_traces.json"))
    rep = commands.add_parser("replay")
    rep.add_argument("--traces", type=Path, default=Path("nasd_traces.json"))
    rep.add_argument("--pool", choices=["simple", "multi"], default="multi")
    rep.add_argument("--n", type=int, default=6)
    rep.add_argument("--gamma", type=int, default=8)
    rep.add_argument("--top-k-filler", type=int, default=3)
    rep.add_argument("--no-stop-if-unknown", action="store_true")
    rep.add_argument("--branching", type=int, default=1, help="candidates per node (token trees)")
    args = parser.parse_args(argv)
    if args.command == "record":
        record(args.data, args.per_category, args.max_new_tokens, args.out, args.model)
    else:
        replay(args.traces, args.pool, args.n, args.gamma, args.top_k_filler, not args.no_stop_if_unknown,
               args.branching)


if __name__ == "__main__":
    main()
