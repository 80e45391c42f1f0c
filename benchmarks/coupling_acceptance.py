"""Acceptance of drafter-invariant sampling (the coupled rule) against the standard rule, for one pair.

    python -m benchmarks.coupling_acceptance --target qwen2.5-coder-1.5b-instruct \
        --drafter qwen2.5-coder-0.5b-instruct --prompts 10 --max-new-tokens 128 [--out coupling.json]

The pair must share a tokenizer; --dtype (default: load_model's for the target; the drafter takes the
target's) and --device as in every benchmark (`benchmarks/cli.py`). Acceptance does not depend on
the machine's speed: it can be measured on a busy machine.

Sampling at temperature 0.7, top-p 0.9, a fixed gamma. Two measures, printed (and written with
--out) as one JSON object:

- `alpha`: drafts accepted / drafts proposed of `speculative_generate` with the standard rule
  (min(1, p/q), `drafter_invariant=False`) and with the coupled one (`drafter_invariant=True`), the
  same prompts and seeds; and each one's `tau` (tokens per verification step) and tokens per target
  pass (the prefill included).
- `position_acceptance`: along the target's own sampled text, the exact chance, averaged over
  positions, that one draft is accepted by each rule: standard sum_x min(p, q) (the most any
  coupling reaches), inverse-CDF coupling (the shipped rule: the overlap of the two CDFs' intervals
  of each token) and Gumbel-max coupling (Daliri et al. 2024: argmax(log p + G) = argmax(log q + G),
  Monte Carlo over `--gumbel-samples` noise vectors; not shipped, for comparison).
"""

from __future__ import annotations

import json

import torch

from benchmarks import cli
from benchmarks.prompts import encode, load_workload
from sampling import SpeculativeStats, autoregressive_generate, speculative_generate
from utils.loading import end_token_ids, load_model
from utils.logits_processors import NucleusProcessor
from utils.runners.model_info import input_device


def acceptance_chances(p: torch.Tensor, q: torch.Tensor, gumbel_samples: int, generator: torch.Generator) -> dict[str, float]:
    """P(one draft accepted) under each rule at one position, p and q (V,) distributions (float64)."""
    standard = float(torch.minimum(p, q).sum())
    p_high, q_high = p.cumsum(0), q.cumsum(0)
    overlap = torch.minimum(p_high, q_high) - torch.maximum(p_high - p, q_high - q)
    inverse_cdf = float(overlap.clamp(min=0).sum())
    uniform = torch.rand(gumbel_samples, len(p), generator=generator, dtype=p.dtype).clamp(min=1e-300)
    noise = -(-uniform.log()).log()
    gumbel = float(((p.log() + noise).argmax(-1) == (q.log() + noise).argmax(-1)).double().mean())
    return {"standard": standard, "inverse_cdf": inverse_cdf, "gumbel_max": gumbel}


@torch.no_grad()
def position_acceptance(target, drafter, prompt: list[int], output: list[int], processor, gumbel_samples: int,
                        generator: torch.Generator) -> list[dict[str, float]]:
    """`acceptance_chances` at every generated position of `output` (the target's sample after `prompt`)."""
    ids = torch.tensor([prompt + output], device=input_device(target))
    width = min(target.config.vocab_size, drafter.config.vocab_size)
    logits_p = target(ids).logits[0, len(prompt) - 1 : -1, :width].double().cpu()
    logits_q = drafter(ids.to(input_device(drafter))).logits[0, len(prompt) - 1 : -1, :width].double().cpu()
    chances = []
    for t in range(len(output)):
        history = prompt + output[:t]
        p = processor(logits_p[t : t + 1], history)[0]
        q = processor(logits_q[t : t + 1], history)[0]
        chances.append(acceptance_chances(p, q, gumbel_samples, generator))
    return chances


def main(argv: list[str] | None = None) -> dict:
    parser = cli.benchmark_parser(__doc__)
    cli.add_models(parser, drafter="drafter: a name load_model takes or a folder, e.g. qwen2.5-coder-0.5b-instruct",
                   required=True)
    cli.add_workload(parser, workload="humaneval", per_category=None)
    parser.add_argument("--prompts", type=int, default=10, help="HumanEval prompts (Spec-Bench: per task)")
    cli.add_run(parser, max_new_tokens=128, out=None, out_help="also write the JSON here")
    parser.add_argument("--gamma", type=int, default=4)
    cli.add_sampling(parser, flag=False)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gumbel-samples", type=int, default=256)
    args = cli.parse(parser, argv)
    if args.prompts < 1:
        parser.error(f"--prompts must be >= 1, got {args.prompts}")

    target, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    drafter, drafter_tokenizer = load_model(args.drafter, dtype=target.dtype, device=args.device)
    if drafter_tokenizer.get_vocab() != tokenizer.get_vocab():
        parser.error(f"--drafter {args.drafter} has another tokenizer than --target {args.model}: the rules compare "
                     "p and q over one vocabulary")
    processor = NucleusProcessor(temperature=args.temperature, top_p=args.top_p)
    prompts = [encode(tokenizer, text) for _, text in load_workload(args.workload, args.prompts, path=args.data)]
    eos = end_token_ids(target, tokenizer)
    stats = {"standard": SpeculativeStats(), "coupled": SpeculativeStats()}
    chances: list[dict[str, float]] = []
    noise = torch.Generator().manual_seed(args.seed)
    for i, prompt in enumerate(prompts):
        for rule, stat in stats.items():
            speculative_generate(prompt, drafter, target, gamma=args.gamma, logits_processor=processor,
                                 max_gen_len=args.max_new_tokens, end_tokens_id=eos, stats=stat,
                                 generator=torch.Generator().manual_seed(args.seed + i),
                                 drafter_invariant=rule == "coupled")
        output = autoregressive_generate(prompt, target, logits_processor=processor, max_gen_len=args.max_new_tokens,
                                         end_tokens_id=eos, generator=torch.Generator().manual_seed(args.seed + i))
        chances += position_acceptance(target, drafter, prompt, output, processor, args.gumbel_samples, noise)
    result = {
        "target": args.model, "drafter": args.drafter, "dtype": str(target.dtype), "workload": args.workload, "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens, "gamma": args.gamma, "temperature": args.temperature, "top_p": args.top_p,
        "alpha": {rule: round(stat.alpha, 4) for rule, stat in stats.items()},
        "tau": {rule: round(stat.tau, 3) for rule, stat in stats.items()},
        "tokens_per_target_pass": {rule: round(stat.tokens_per_target_pass, 3) for rule, stat in stats.items()},
        "position_acceptance": {rule: round(sum(c[rule] for c in chances) / max(1, len(chances)), 4)
                                for rule in ("standard", "inverse_cdf", "gumbel_max")},
        "positions": len(chances),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
