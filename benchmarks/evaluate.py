"""Decode your own JSONL of prompts in batches, split over processes or GPUs with accelerate.

    python -m benchmarks.evaluate prompts.jsonl --method nasd --batch-size 4 --out outputs.jsonl
    accelerate launch -m benchmarks.evaluate prompts.jsonl --method nasd --out outputs.jsonl   # every GPU
    accelerate launch --multi_gpu --num_processes 2 -m benchmarks.evaluate prompts.jsonl ...  # 2 CPU processes

Each input line is a JSON object with "prompt" (a string) or "turns" (a list: the first turn is
used), and optionally "id". Each process takes a contiguous share of the prompts (accelerate's
`split_between_processes`), decodes it `--batch-size` rows at a time with the chosen method, and
the main process writes one JSONL line per prompt, in input order: id, prompt, output text, ids,
alpha (speculative methods) and the process's seconds for the batch the prompt was in. With
--check (greedy), each output is compared with transformers' greedy `generate` of its prompt, and
the line says how it differs: "difference" null (the same tokens), or a near-tie or a defect
(`benchmarks/exactness.py`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import gather_object

from benchmarks import cli
from benchmarks.exactness import classify, transformers_greedy
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
    parser = cli.benchmark_parser(__doc__)
    parser.add_argument("data", type=Path, help="a JSONL file of prompts")
    parser.add_argument("--method", choices=METHODS, default="nasd")
    parser.add_argument("--batch-size", type=int, default=4)
    cli.add_run(parser, max_new_tokens=128, out=Path("outputs.jsonl"), out_help="the JSONL file written")
    cli.add_models(parser)
    cli.add_sampling(parser)
    parser.add_argument("--check", action="store_true", help="greedy: compare every output with transformers' "
                        "greedy generate (a near-tie or a defect where they differ)")
    args = cli.parse(parser, argv)
    if args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.check and args.sample:
        parser.error("--check compares greedy outputs: drop --sample")
    state = PartialState(cpu=not torch.cuda.is_available())  # CPU processes talk over gloo
    device = args.device or (str(state.device) if state.device.type != "cpu" else None)
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=device)
    sample = cli.sampling_settings(args)
    records = [(index, key, text) for index, (key, text) in enumerate(read_prompts(args.data))]
    end_tokens = end_token_ids(model, tokenizer)
    with state.split_between_processes(records) as mine:
        prompts = [encode(tokenizer, text) for _, _, text in mine]
        results = evaluate(prompts, model, method=args.method,
                           batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, end_tokens=end_tokens,
                           processor=NucleusProcessor(**sample) if sample else GreedyProcessor(),
                           seed=mine[0][0] if mine else 0)
        if args.check:  # after the timed decoding: transformers' greedy output of each prompt, and the difference
            for prompt, result in zip(prompts, results, strict=True):
                reference = transformers_greedy(model, prompt, args.max_new_tokens, end_tokens)
                difference = classify(model, prompt, reference, result["ids"])
                result["difference"] = difference.as_dict() if difference else None
        lines = [{"index": index, "id": key, "prompt": text, "output": tokenizer.decode(result["ids"], skip_special_tokens=True),
                  **result, "process": state.process_index} for (index, key, text), result in zip(mine, results, strict=True)]
    lines = sorted(gather_object(lines) if state.num_processes > 1 else lines, key=lambda line: line["index"])
    if state.is_main_process:
        args.out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return lines


if __name__ == "__main__":
    main()
