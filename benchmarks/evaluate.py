"""Decode your own JSONL of prompts in batches, split over processes or GPUs with accelerate.

    python -m benchmarks.evaluate prompts.jsonl --method nasd --batch-size 4 --out outputs.jsonl
    accelerate launch -m benchmarks.evaluate prompts.jsonl --method nasd --out outputs.jsonl   # every GPU
    accelerate launch --multi_gpu --num_processes 2 -m benchmarks.evaluate prompts.jsonl ...  # 2 CPU processes

Each input line is a JSON object with "prompt" (a string) or "turns" (a list: the first turn is
used), and optionally "id". Each process takes a contiguous share of the prompts (accelerate's
`split_between_processes`), decodes it `--batch-size` rows at a time with the chosen method, and
the main process writes one JSONL line per prompt, in input order: id, prompt, output text, ids,
alpha (speculative methods) and the process's seconds for the batch the prompt was in.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import gather_object

from benchmarks.prompts import encode
from ngram_assisted import MultiDynaGram, ngram_assisted_speculative_generate
from sampling import autoregressive_generate
from utils.loading import end_token_ids, load_model
from utils.logits_processors import GreedyProcessor, NucleusProcessor

METHODS = ("ar", "nasd")


def read_prompts(path: Path) -> list[tuple[str, str]]:
    """(id, text) per non-empty line."""
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        record = json.loads(line)
        text = record.get("prompt") or (record.get("turns") or [None])[0]
        if not isinstance(text, str):
            raise ValueError(f"{path}:{number}: a line needs a string 'prompt' or a list 'turns'")
        prompts.append((str(record.get("id", record.get("question_id", number))), text))
    return prompts


def evaluate(prompts: list[list[int]], model, *, method: str = "nasd", batch_size: int = 4, max_new_tokens: int = 128,
             end_tokens: list[int] | None = None, processor=GreedyProcessor(), seed: int = 0) -> list[dict]:
    """Decode token-id prompts `batch_size` at a time -> one {"ids", "alpha", "seconds"} per prompt."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    results = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        generators = [torch.Generator().manual_seed(seed + start + i) for i in range(len(batch))]
        common = dict(max_gen_len=max_new_tokens, end_tokens_id=end_tokens, logits_processor=processor, generator=generators)
        began = time.perf_counter()
        if method == "ar":
            outputs = [(ids, None) for ids in autoregressive_generate(batch, model, **common)]
        else:
            outputs = ngram_assisted_speculative_generate(batch, [MultiDynaGram(8) for _ in batch], model, **common)
        seconds = time.perf_counter() - began
        results += [{"ids": ids, "alpha": alpha, "seconds": seconds} for ids, alpha in outputs]
    return results


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", type=Path, help="a JSONL file of prompts")
    parser.add_argument("--method", choices=METHODS, default="nasd")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--model", default=None, help="default: the built-in SmolLM2-135M-Instruct")
    parser.add_argument("--sample", action="store_true", help="temperature 0.7, top-p 0.9 (seeded per prompt)")
    parser.add_argument("--out", type=Path, default=Path("outputs.jsonl"))
    args = parser.parse_args(argv)
    if not args.data.exists():
        parser.error(f"{args.data} does not exist")
    if args.batch_size < 1 or args.max_new_tokens < 1:
        parser.error("--batch-size and --max-new-tokens must be >= 1")
    state = PartialState(cpu=not torch.cuda.is_available())  # CPU processes talk over gloo
    device = str(state.device) if state.device.type != "cpu" else None
    model, tokenizer = load_model(args.model, device=device)
    records = [(index, key, text) for index, (key, text) in enumerate(read_prompts(args.data))]
    with state.split_between_processes(records) as mine:
        results = evaluate([encode(tokenizer, text) for _, _, text in mine], model, method=args.method,
                           batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                           end_tokens=end_token_ids(model, tokenizer),
                           processor=NucleusProcessor(0.7, 0.9) if args.sample else GreedyProcessor(),
                           seed=mine[0][0] if mine else 0)
        lines = [{"index": index, "id": key, "prompt": text, "output": tokenizer.decode(result["ids"], skip_special_tokens=True),
                  **result, "process": state.process_index} for (index, key, text), result in zip(mine, results, strict=True)]
    lines = sorted(gather_object(lines) if state.num_processes > 1 else lines, key=lambda line: line["index"])
    if state.is_main_process:
        args.out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return lines


if __name__ == "__main__":
    main()
