"""Tau of NASD against prompt lookup on HumanEval prompts: real greedy decoding, no clock.

    python -m benchmarks.pld_tau --prompts 20                         # the built-in SmolLM2-135M
    python -m benchmarks.pld_tau --prompts 10 --model qwen2.5-coder-0.5b-instruct

Three methods on the same prompts (the development set's, `benchmarks/data/humaneval.jsonl`):
- `nasd`: `ngram_assisted_speculative_generate` with a fresh `MultiDynaGram(8)` per prompt;
- `pld`: `TransformersPromptLookup` (transformers' rule, below) in the library's loop;
- `hf_pld`: transformers' own `generate(prompt_lookup_num_tokens=10, max_matching_ngram_size=2)`,
  its target passes counted with a forward hook (it has no separate prompt pass: its first pass
  verifies the first candidates too, so every pass counts).
Tau is generated tokens per verification (the prompt pass excluded): it depends on the drafts and
the target's tokens only, not on the machine's speed, so a busy machine measures it right. NASD's
draft sizes follow a cost table: `--costs bf16-1.5b` (default) is the one measured for
Qwen2.5-Coder-1.5B in bfloat16 on a Zen 5 CPU (issue 34: a pass over 1 + k tokens costs a
one-token pass up to k = 8), `machine` the table measured here for the model in use.
`--sample` (temperature 0.7, top-p 0.9 unless `--temperature`, `--top-p`): ours only, each method from seed 0
(transformers' prompt lookup is left out).
"""

from __future__ import annotations

import statistics

import torch

from benchmarks import cli
from benchmarks.prompts import encode, load_humaneval
from ngram_assisted import MultiDynaGram, ngram_assisted_speculative_generate
from sampling import DraftTree, SpeculativeStats, speculative_generate
from utils.cost_model import PassCosts
from utils.loading import end_token_ids, load_model
from utils.logits_processors import NucleusProcessor

# Qwen2.5-Coder-1.5B, bfloat16, AMD EPYC Zen 5 (2 cores): cost of a pass over 1 + k tokens / one token.
BF16_1_5B = {0: 1.0, 8: 1.0, 12: 1.11, 16: 1.19, 24: 1.40, 31: 1.64}


class TransformersPromptLookup:
    """transformers' `PromptLookupCandidateGenerator` as a `Drafter`: the last `max_ngram` (then
    fewer) tokens are searched in the whole text, prompt and output; the first match from the left
    that has a continuation proposes up to `num_tokens` tokens after it (through the end of the
    text, so a match may overlap its own continuation), cut before the first end token."""

    forward_passes = 0

    def __init__(self, num_tokens: int = 10, max_ngram: int = 2, end_tokens: list[int] | None = None) -> None:
        self.num_tokens, self.max_ngram, self.end_tokens = num_tokens, max_ngram, set(end_tokens or [])

    def start(self, sequences) -> None:
        pass

    def lookup(self, text: list[int]) -> list[int]:
        for n in range(min(self.max_ngram, len(text) - 1), 0, -1):
            tail = text[-n:]
            for start in range(len(text) - n + 1):  # left to right, as transformers' nonzero() order
                if text[start : start + n] == tail and start + n < len(text):
                    chosen = text[start + n : start + n + self.num_tokens]
                    cut = next((i for i, t in enumerate(chosen) if t in self.end_tokens), len(chosen))
                    if cut:  # transformers keeps the match and drafts nothing when it begins with an end token
                        return chosen[:cut]
                    return []
        return []

    def draft(self, sequences, max_drafts, max_depths):
        return [(DraftTree.chain(self.lookup(text)[: min(max_drafts, depth)]), None)
                for text, depth in zip(sequences, max_depths, strict=True)]

    def update(self, sequences, paths, target_logits, p) -> None:
        pass

    def select_rows(self, keep) -> None:
        pass


def hf_prompt_lookup_tau(model, ids: list[int], new_tokens: int, end: list[int]) -> tuple[list[int], float]:
    """transformers' prompt lookup -> (its tokens, generated tokens / target passes). Its first pass
    scores the prompt and the first candidates together: a verification like every other one."""
    passes = []
    hook = model.register_forward_hook(lambda *_: passes.append(1))
    try:
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=new_tokens, do_sample=False, prompt_lookup_num_tokens=10,
                             max_matching_ngram_size=2, eos_token_id=end, pad_token_id=end[0])
    finally:
        hook.remove()
    tokens = out[0, len(ids):].tolist()
    return tokens, len(tokens) / max(len(passes), 1)


def main(argv: list[str] | None = None) -> None:
    parser = cli.benchmark_parser(__doc__)
    cli.add_models(parser, device=False)
    parser.add_argument("--prompts", type=int, default=20, help="HumanEval development prompts (even task ids)")
    parser.add_argument("--offset", type=int, default=0, help="skip the first prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=None, help="NASD's gamma (default: the function's)")
    parser.add_argument("--branching", type=int, default=None, help="NASD's branching (default: the function's)")
    parser.add_argument("--costs", choices=["bf16-1.5b", "machine"], default="bf16-1.5b")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' own prompt lookup")
    cli.add_sampling(parser)
    args = cli.parse(parser, argv)

    model, tokenizer = load_model(args.model, dtype=args.dtype)
    end = end_token_ids(model, tokenizer)
    cost = PassCosts(relative=dict(BF16_1_5B), one_token_seconds=None) if args.costs == "bf16-1.5b" else None
    nasd_options = {name: value for name, value in (("gamma", args.gamma), ("branching", args.branching))
                    if value is not None}
    taus: dict[str, list[float]] = {"nasd": [], "pld": [], "hf_pld": []}
    totals = {name: [0, 0] for name in ("nasd", "pld")}
    differ = 0
    for _, text in load_humaneval(args.prompts, args.offset):
        ids = encode(tokenizer, text)
        common = dict(max_gen_len=args.max_new_tokens, end_tokens_id=end)
        if args.sample:  # both exact: the same tokens for one seed (the coupled rule, `sampling.loop.randomness`)
            common.update(logits_processor=NucleusProcessor(**cli.sampling_settings(args)),
                          generator=torch.Generator().manual_seed(0))
        stats = {name: SpeculativeStats() for name in ("nasd", "pld")}
        nasd, _ = ngram_assisted_speculative_generate(ids, MultiDynaGram(8), model, draft_cost=cost,
                                                      stats=stats["nasd"], **nasd_options, **common)
        if args.sample:
            common["generator"] = torch.Generator().manual_seed(0)
        pld, _ = speculative_generate(ids, TransformersPromptLookup(end_tokens=end), model, gamma=10,
                                      stats=stats["pld"], **common)
        differ += nasd != pld
        for name, s in stats.items():
            taus[name].append(s.tau)
            totals[name][0] += s.generated_tokens
            totals[name][1] += s.steps
        line = f"nasd {stats['nasd'].tau:5.2f}  pld {stats['pld'].tau:5.2f}"
        if not (args.no_hf or args.sample):
            hf, tau = hf_prompt_lookup_tau(model, ids, args.max_new_tokens, end)
            taus["hf_pld"].append(tau)
            line += f"  hf_pld {tau:5.2f}{'' if hf == pld else ' (other tokens)'}"
        print(line, flush=True)
    for name, values in taus.items():
        if values:
            pooled = f", pooled {totals[name][0] / totals[name][1]:.2f}" if name in totals else ""
            print(f"{name:7} mean tau {statistics.fmean(values):.2f}{pooled}")
    print(f"prompts {len(taus['nasd'])}, NASD's output differs from PLD's in {differ} (must be 0: the same greedy "
          f"or seeded tokens)")


if __name__ == "__main__":
    main()
