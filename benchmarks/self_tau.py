"""Tau of the self-drafter (`sampling.quantized_drafter`) at a fixed gamma: real greedy decoding, no
pass timed (tau, the drafts' acceptance and the outputs do not depend on the machine's speed).

    python -m benchmarks.self_tau --model qwen2.5-coder-1.5b-instruct --prompts 4 --gamma 5
    python -m benchmarks.self_tau --workload humaneval --prompts 4 --variants int4_shared,int4_own

Variants: `int4_shared` (4 bits, drafting over the target's cache: no prompt pass of its own),
`int4_own` (4 bits, its own cache and prompt pass: the plain design), `int8_shared`. Also reported:
the seconds of the first build and of a later start (loaded from `SPECDEC_CACHE`: a wall clock of
one-time work, not a speed figure) and the drafter's bytes over the target's weight bytes.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from benchmarks import cli
from benchmarks.prompts import encode, load_workload
from sampling import SpeculativeStats, quantized_drafter, speculative_generate
from utils.loading import end_token_ids, load_model
from utils.quantize import QuantizedLinear

VARIANTS = {"int4_shared": (4, True), "int4_own": (4, False), "int8_shared": (8, True)}


def drafter_bytes(drafter) -> int:
    """Bytes the drafter adds to the target's: its quantized layers' buffers (the rest is shared)."""
    return sum(b.numel() * b.element_size() for m in drafter.modules() if isinstance(m, QuantizedLinear)
               for b in m.buffers(recurse=False))


def main(argv: list[str] | None = None) -> dict:
    parser = cli.benchmark_parser(__doc__)
    cli.add_workload(parser, per_category=None)
    cli.add_models(parser, device=False)
    parser.add_argument("--prompts", type=int, default=4, help="prompts (the workload's development set)")
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = cli.parse(parser, argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if set(variants) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(set(variants) - set(VARIANTS))}; choose from {sorted(VARIANTS)}")
    target, tokenizer = load_model(args.model, dtype=args.dtype)
    end = end_token_ids(target, tokenizer)
    texts = load_workload(args.workload, 1 if args.workload == "spec_bench" else args.prompts,
                          path=args.data)[: args.prompts]
    weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    result: dict = {"model": args.model, "gamma": args.gamma, "max_new_tokens": args.max_new_tokens, "variants": {}}
    for variant in variants:
        bits, share = VARIANTS[variant]
        start = time.perf_counter()
        drafter = quantized_drafter(target, bits=bits, cache=True)
        built = time.perf_counter() - start
        start = time.perf_counter()
        drafter = quantized_drafter(target, bits=bits, cache=True)
        loaded = time.perf_counter() - start
        taus, outputs = [], []
        for task, text in texts:
            stats = SpeculativeStats()
            out, _ = speculative_generate(encode(tokenizer, text), drafter, target, gamma=args.gamma,
                                          max_gen_len=args.max_new_tokens, end_tokens_id=end, stats=stats,
                                          share_cache=share)
            taus.append({"task": task, "tau": stats.tau, "alpha": stats.alpha, "tokens": len(out)})
            outputs.append(out)
        result["variants"][variant] = {
            "build_seconds": built, "later_start_seconds": loaded,
            "added_bytes_over_target": drafter_bytes(drafter) / weight_bytes,
            "tau_mean": statistics.mean(t["tau"] for t in taus), "per_prompt": taus, "outputs": outputs}
        print(json.dumps({k: v for k, v in result["variants"][variant].items() if k != "outputs"}, indent=1), flush=True)
    first = [result["variants"][v]["outputs"] for v in variants]
    result["outputs_equal"] = all(o == first[0] for o in first)  # greedy: every variant is the target's greedy text
    print(json.dumps({"outputs_equal": result["outputs_equal"]}), flush=True)
    return result


if __name__ == "__main__":
    with torch.no_grad():
        main()
