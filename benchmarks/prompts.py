"""The benchmarks' prompts, from the files of `benchmarks/data/` (their licences and sources: its README).

    load_workload("spec_bench", 2)    # [(task, user message), ...]: 2 Spec-Bench prompts per task
    load_workload("humaneval", 10)    # 10 HumanEval development prompts, task "code"

Every benchmark reads its prompts here, so that nothing it runs needs a file outside the repository.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from benchmarks.summary import TASKS

DATA = Path(__file__).resolve().parent / "data"
DEFAULT_DATA = DATA / "spec_bench_dev.jsonl"  # 240 Spec-Bench prompts (Apache-2.0)
HUMANEVAL_DATA = DATA / "humaneval.jsonl"  # HumanEval's even task ids only: the development set (MIT)
WORKLOADS = ("spec_bench", "humaneval")
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
CODE_TASK = "code"  # the task of every HumanEval prompt
CODE_REQUEST = ("Complete the following Python function. Reply with the whole function in one ```python block."
                "\n\n```python\n{prompt}```")


def task_of(category: str) -> str:
    """Spec-Bench's task of a category: the eight MT-bench categories are "multi-turn conversation"."""
    return "multi-turn conversation" if category in MT_BENCH else category


def load_prompts(path: Path = DEFAULT_DATA, per_category: int = 2, *, held_out: bool = False,
                 offset: int = 0) -> list[tuple[str, str]]:
    """(task, first turn) pairs of a Spec-Bench file, at most `per_category` per task, in file order,
    tasks in `summary.TASKS` order; `held_out`: from the end of the file (prompts the benchmark, which
    reads from the start, never uses); `offset`: skip each task's first `offset` prompts (a tuning set
    apart from the evaluation's)."""
    chosen: dict[str, list[str]] = defaultdict(list)
    lines = Path(path).read_text().splitlines()
    for line in reversed(lines) if held_out else lines:
        if line.strip():
            record = json.loads(line)
            task = task_of(record["category"])
            if len(chosen[task]) < offset + per_category:
                chosen[task].append(record["turns"][0])
    return [(task, text) for task in TASKS for text in chosen.get(task, [])[offset:]]


def load_humaneval(count: int, offset: int = 0, *, path: Path = HUMANEVAL_DATA,
                   held_out: bool = False) -> list[tuple[str, str]]:
    """("code", user message) pairs for `count` HumanEval development prompts after the first `offset`
    (in task-id order; `held_out`: from the end of the file). The message asks the model to complete
    the function and holds the prompt's code (signature and docstring)."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    records = records[::-1] if held_out else records
    return [(CODE_TASK, CODE_REQUEST.format(prompt=r["prompt"])) for r in records[offset : offset + count]]


def load_workload(name: str, per_category: int, offset: int = 0, *, held_out: bool = False,
                  path: Path | None = None) -> list[tuple[str, str]]:
    """(task, user message) pairs of a workload: "spec_bench" (`per_category` prompts of each of its
    six tasks) or "humaneval" (`per_category` prompts of its one task, "code"). `path`: a file of the
    workload's format in place of its default."""
    if name == "spec_bench":
        return load_prompts(path or DEFAULT_DATA, per_category, held_out=held_out, offset=offset)
    if name == "humaneval":
        return load_humaneval(per_category, offset, path=path or HUMANEVAL_DATA, held_out=held_out)
    raise ValueError(f"workload must be one of {WORKLOADS}, got {name!r}")


def encode(tokenizer, text: str) -> list[int]:
    """A user message as the model's prompt ids: through the chat template when the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return tokenizer(text)["input_ids"]
