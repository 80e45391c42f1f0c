"""Prompt lookup decoding (PLD, Saxena 2023) as your own drafter, through the library's public door.

PLD drafts by copying: find the last few tokens of the text earlier in the text, and propose what
followed them there. It needs no model, so its drafts are deterministic (q None) and every
sampling mode stays exact (docs/drafters.md). Run it against NASD on the built-in model:

    python examples/pld.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the library, from a plain checkout

from sampling import DraftTree


class PromptLookupDrafter:
    """The `Drafter` protocol (batch form) for PLD: the longest of the last `max_ngram` .. 1 tokens
    found earlier in the row's text, and up to `max_drafts` tokens that followed its latest match."""

    forward_passes = 0  # no model passes spent drafting

    def __init__(self, max_ngram: int = 3) -> None:
        self.max_ngram = max_ngram

    def start(self, sequences: list[list[int]]) -> None:
        pass  # nothing to remember: each draft reads the whole text

    def draft(self, sequences, max_drafts, max_depths):
        return [(DraftTree.chain(self.lookup(text, min(max_drafts, depth))), None)
                for text, depth in zip(sequences, max_depths, strict=True)]

    def lookup(self, text: list[int], k: int) -> list[int]:
        for n in range(min(self.max_ngram, len(text) - 1), 0, -1):
            tail = text[-n:]
            for start in range(len(text) - n - 1, -1, -1):  # the latest earlier match first
                if text[start : start + n] == tail:
                    return text[start + n : start + n + k] if k > 0 else []
        return []

    def update(self, sequences, paths, target_logits, p) -> None:
        pass  # the accepted tokens are in the next call's text already

    def select_rows(self, keep: list[int]) -> None:
        pass  # no per-row state


def main() -> None:
    from ngram_assisted import MultiDynaGram, ngram_assisted_speculative_generate
    from sampling import SpeculativeStats, speculative_generate
    from utils.loading import end_token_ids, load_model

    model, tokenizer = load_model()  # the built-in SmolLM2-135M-Instruct, offline
    code = "def total(values):\n    result = 0\n    for value in values:\n        result += value\n    return result\n"
    messages = [{"role": "user", "content": f"Rename `result` to `acc` in this function:\n```python\n{code}```"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    common = dict(max_gen_len=80, end_tokens_id=end_token_ids(model, tokenizer))
    outputs = {}
    for name, run in [
        ("PLD (examples/pld.py)", lambda stats: speculative_generate(ids, PromptLookupDrafter(), model, gamma=8,
                                                                     stats=stats, **common)),
        ("NASD, MultiDynaGram(8)", lambda stats: ngram_assisted_speculative_generate(ids, MultiDynaGram(8), model,
                                                                                    stats=stats, **common)),
    ]:
        stats = SpeculativeStats()
        outputs[name], alpha = run(stats)
        print(f"{name:24} {stats.generated_tokens} tokens in {stats.target_forwards} target passes "
              f"(tau {stats.tau:.2f}), alpha {alpha:.2f}")
    print("same tokens (greedy):", len({tuple(out) for out in outputs.values()}) == 1)
    print(tokenizer.decode(next(iter(outputs.values())), skip_special_tokens=True))


if __name__ == "__main__":
    main()
