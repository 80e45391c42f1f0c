"""Tune NASD's drafting policy offline: record greedy outputs once, replay drafters in seconds.

    python -m benchmarks.nasd_replay record --per-category 4 --offset 2 --out nasd_traces.json  # ~3 min
    python -m benchmarks.nasd_replay replay --traces nasd_traces.json                          # ~10 s
    python -m benchmarks.nasd_replay replay --drafter suffix                                   # the peer
    python -m benchmarks.nasd_replay compare                      # where NASD and the peer disagree

`record` decodes held-out Spec-Bench prompts (taken from the end of the file, so that they differ
from the benchmark's, which come from the start; `--offset 2` also skips the two per task that
`suffix_compare` evaluates on) greedily and stores each output with the target's top-3 tokens and
their probabilities at every position, and this machine's measured cost table. `replay` runs the
real `NgramDrafter` (or SuffixDecoding's drafter, `--drafter suffix`, when built) against those
traces: in greedy mode a draft is accepted iff it equals the recorded token, so the replay is
exact, and it reports per task tau, drafted nodes per step, alpha and the modelled speed (tokens /
the summed cost of every verification pass under the recorded table), as `suffix_compare` does
with real passes. Off the accepted path the trace has no scores, so recycling learns less than in
a real run. It ignores Python overhead and noise: use it to compare policies, then confirm with
`suffix_compare` and spec_bench.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks import cli
from benchmarks.prompts import DEFAULT_DATA, encode, load_prompts
from benchmarks.summary import TASKS, geometric_mean
from ngram_assisted import MultiDynaGram, NgramDrafter, NgramOptions, SimpleDynaGram
from utils.cost_model import PRIOR, _interpolate


def record(data: Path, per_category: int, offset: int, max_new_tokens: int, out: Path, model_name: str | None,
           device: str | None = None, dtype: str | None = None) -> None:
    from sampling import autoregressive_generate
    from utils.calibration import pass_costs
    from utils.loading import end_token_ids, load_model
    from utils.runners.model_info import input_device

    model, tokenizer = load_model(model_name, dtype=dtype, device=device)
    end = end_token_ids(model, tokenizer)
    traces = []
    for task, text in load_prompts(data, per_category, held_out=True, offset=offset):
        prompt = encode(tokenizer, text)
        generated = autoregressive_generate(prompt, model, max_gen_len=max_new_tokens, end_tokens_id=end)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + generated], device=input_device(model))).logits[0, len(prompt) - 1 : -1]
        top3 = logits.float().softmax(dim=-1).topk(3, dim=-1)
        traces.append({"task": task, "prompt": prompt, "generated": generated, "top3": top3.indices.tolist(),
                       "top3_p": top3.values.tolist(), "vocab": logits.shape[-1]})
    out.write_text(json.dumps({"cost_table": pass_costs(model).table(), "traces": traces}))


def load_traces(path: Path) -> tuple[list[dict], dict[int, float]]:
    """(traces, cost table k -> relative cost); files recorded before the table was: the prior."""
    data = json.loads(path.read_text())
    if isinstance(data, list):
        return data, dict(PRIOR)
    return data["traces"], {int(k): v for k, v in data["cost_table"].items()}


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


def accepted_path(tree, generated: list[int], position: int) -> list[int]:
    """The nodes of `tree` that greedy decoding accepts at `position` of the recorded output."""
    path, node = [], -1
    while position + len(path) < len(generated):
        wanted = generated[position + len(path)]
        node = next((i for i, parent in enumerate(tree.parents) if parent == node and tree.tokens[i] == wanted), None)
        if node is None:
            break
        path.append(node)
    return path


def replay_one(trace: dict, drafter, gamma: int, cost: Callable[[int], float]) -> dict:
    """One recorded greedy trace replayed with `drafter` -> tokens, steps, drafted nodes, accepted
    drafts and the summed cost of the verification passes."""
    sequence, generated = list(trace["prompt"]), trace["generated"]
    drafter.start(sequence)
    position, steps, nodes, accepted, total_cost = 0, 0, 0, 0, 0.0
    while position < len(generated):
        tree, _ = drafter.draft(sequence, gamma, len(generated) - position - 1)
        path = accepted_path(tree, generated, position)
        n = len(path)
        sequence += generated[position : position + n + 1]
        drafter.update(sequence, path, stand_in_logits(trace, position, path, len(tree)), None)
        steps, nodes, accepted, total_cost = steps + 1, nodes + len(tree), accepted + n, total_cost + cost(len(tree))
        position += n + 1
    return {"task": trace["task"], "tokens": len(generated), "steps": steps, "nodes": nodes, "accepted": accepted,
            "cost": total_cost}


def compare(traces_path: Path, gamma: int = 8) -> Counter:
    """Where NASD and SuffixDecoding disagree, step by step along NASD's own decoding: at each step
    both draft for the same sequence, and the steps where one accepts more are counted, with the
    tokens it gains, by why the other lost (it drafted nothing, its first token was wrong, or its
    draft was shorter or cut) and, for the peer's wins, whether the current text holds the match
    (`CopyIndex`) or only the peer's global cache of earlier responses does."""
    traces, table = load_traces(traces_path)
    cost = lambda k: _interpolate(table, k)  # noqa: E731
    make_nasd, make_suffix = nasd_drafters(), suffix_drafters()
    tally: Counter = Counter()
    for trace in traces:
        sequence, generated = list(trace["prompt"]), trace["generated"]
        nasd, peer = make_nasd(trace, cost), make_suffix(trace, cost)
        nasd.start(sequence)
        peer.start(list(sequence))
        position = 0
        while position < len(generated):
            room = len(generated) - position - 1
            peer_tree, _ = peer.draft(sequence, gamma, room)
            tree, _ = nasd.draft(sequence, gamma, room)
            mine, theirs = accepted_path(tree, generated, position), accepted_path(peer_tree, generated, position)
            if len(mine) != len(theirs):
                loser, won = (tree, "suffix") if len(theirs) > len(mine) else (peer_tree, "nasd")
                lost = min(len(mine), len(theirs))
                why = "drafted nothing" if not len(loser) else "first token wrong" if not lost else "shorter or cut"
                if won == "suffix" and not lost:
                    in_text = nasd.copies.match_length(sequence, generated[position]) > 0
                    why += ", match in this text" if in_text else ", match only in earlier responses"
                tally[(f"{won} ahead", why, "steps")] += 1
                tally[(f"{won} ahead", why, "tokens")] += abs(len(mine) - len(theirs))
            sequence += generated[position : position + len(mine) + 1]
            nasd.update(sequence, mine, stand_in_logits(trace, position, mine, len(tree)), None)
            peer.update(sequence, [], None, None)
            position += len(mine) + 1
    for (side, why, unit), count in sorted(tally.items()):
        if unit == "steps":
            print(f"{side:12} {why:50} {count:4} steps, {tally[(side, why, 'tokens')]:4} tokens")
    return tally


def summarise(records: list[dict]) -> dict[str, dict[str, float]]:
    """Per task and overall: tau, nodes per step, alpha, modelled speed (tokens / summed cost)."""
    summary = {}
    for task in [*TASKS, "overall"]:
        mine = [r for r in records if task == "overall" or r["task"] == task]
        if mine:
            total = {key: sum(r[key] for r in mine) for key in ("tokens", "steps", "nodes", "accepted", "cost")}
            summary[task] = {"tau": total["tokens"] / total["steps"], "nodes_per_step": total["nodes"] / total["steps"],
                             "alpha": total["accepted"] / max(total["nodes"], 1),
                             "modelled_speed": total["tokens"] / total["cost"]}
    summary["overall"]["modelled_speed_geomean"] = geometric_mean(
        [summary[t]["modelled_speed"] for t in TASKS if t in summary])
    return summary


def nasd_drafters(pool: str = "multi", n: int = 8, top_k_filler: int = 3, stop_if_unknown: bool = True,
                  branching: int = 3) -> Callable[[dict, Callable[[int], float]], NgramDrafter]:
    """A factory of NASD drafters (a fresh pool per trace, as each generation in suffix_compare)."""
    def make(trace: dict, cost: Callable[[int], float]) -> NgramDrafter:
        ngram = (MultiDynaGram if pool == "multi" else SimpleDynaGram)(n)
        options = NgramOptions(top_k_filler=top_k_filler, stop_if_unknown=stop_if_unknown, branching=branching,
                               draft_cost=cost)
        return NgramDrafter(ngram, options, vocab_size=trace["vocab"])
    return make


def suffix_drafters() -> Callable[[dict, Callable[[int], float]], object]:
    """A factory of SuffixDecoding drafters over one global cache (the peer, or its stand-in)."""
    from benchmarks.suffix_decoding import MAX_TREE_DEPTH, PythonSuffixCache, SuffixDrafter, load_peer

    peer, _ = load_peer()
    cache = (peer or PythonSuffixCache)(max_tree_depth=MAX_TREE_DEPTH)
    return lambda trace, cost: SuffixDrafter(cache)


def replay(traces_path: Path, make_drafter, gamma: int = 8, quiet: bool = False, prior_table: bool = False) -> dict:
    """Every trace replayed with a drafter from `make_drafter(trace, cost)` -> `summarise`'s table;
    `prior_table`: cost the passes with `PRIOR` (another CPU's measurement) instead of the traces'."""
    traces, table = load_traces(traces_path)
    table = dict(PRIOR) if prior_table else table
    cost = lambda k: _interpolate(table, k)  # noqa: E731
    summary = summarise([replay_one(trace, make_drafter(trace, cost), gamma, cost) for trace in traces])
    if not quiet:
        print(" ".join(f"{task[:5]}={v['modelled_speed']:.3f}" for task, v in summary.items())
              + f" | geomean {summary['overall']['modelled_speed_geomean']:.3f}"
              + f" | tau {summary['overall']['tau']:.2f} nodes {summary['overall']['nodes_per_step']:.2f}"
              + f" alpha {summary['overall']['alpha']:.2f}")
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = cli.benchmark_parser(__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record")
    cli.add_workload(rec, workload=None, data=DEFAULT_DATA, per_category=4)
    rec.add_argument("--offset", type=int, default=2, help="skip each task's first held-out prompts")
    cli.add_run(rec, max_new_tokens=128, out=Path("nasd_traces.json"), out_help="the traces written")
    cli.add_models(rec, dtype=None)
    rep = commands.add_parser("replay")
    rep.add_argument("--traces", type=Path, default=Path("nasd_traces.json"))
    rep.add_argument("--drafter", choices=["nasd", "suffix"], default="nasd")
    rep.add_argument("--pool", choices=["simple", "multi"], default="multi")
    rep.add_argument("--n", type=int, default=8)
    rep.add_argument("--gamma", type=int, default=8)
    rep.add_argument("--top-k-filler", type=int, default=3)
    rep.add_argument("--no-stop-if-unknown", action="store_true")
    rep.add_argument("--branching", type=int, default=3, help="candidates per node (token trees)")
    rep.add_argument("--prior-table", action="store_true", help="cost passes with the prior (another CPU's) table")
    cmp = commands.add_parser("compare")
    cmp.add_argument("--traces", type=Path, default=Path("nasd_traces.json"))
    args = cli.parse(parser, argv)
    if args.command == "record":
        record(args.data, args.per_category, args.offset, args.max_new_tokens, args.out, args.model, args.device, args.dtype)
    elif args.command == "compare":
        compare(args.traces)
    elif args.drafter == "suffix":
        replay(args.traces, suffix_drafters(), args.gamma, prior_table=args.prior_table)
    else:
        replay(args.traces, nasd_drafters(args.pool, args.n, args.top_k_filler, not args.no_stop_if_unknown,
                                          args.branching), args.gamma, prior_table=args.prior_table)


if __name__ == "__main__":
    main()
