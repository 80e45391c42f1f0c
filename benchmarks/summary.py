"""Spec-Bench's numbers from its records: medians over repeats, their spread, a noise verdict, goals.

Pure functions of the records (no timing here), so that they are tested on synthetic runs.

A record is one timed generation: {"task", "method", "prompt", "repeat", "tokens", "seconds", "tau",
"alpha", "steps", "steps_without_drafts", "matches_reference", "peak_rss_mib"} (tau, alpha and the
steps: `SpeculativeStats`'s, None for a method without them; tau = tokens per verification step),
and optionally "difference" (greedy: None, or why the output differs from transformers' greedy
output: `benchmarks.exactness.Difference.as_dict()`, a near-tie or a defect).
Every method runs every prompt `repeats` times, interleaved, so a burst of load on the machine hits
one repeat of one method, not one method.
Figures:
- per method and prompt, the median over repeats of seconds per generated token;
- per method and task, tokens/s = 1 / mean over the task's prompts of that median, and the speedup
  against the baseline (transformers' plain `generate`): the ratio of tokens/s. Greedy outputs
  have the same length for every method, so this is the ratio of times;
- the spread: the same speedup computed from each repeat alone, min and max over repeats.
The noise verdict: `CONTROL` runs transformers' plain `generate` a second time, so the control's
speedup must be 1.0 up to noise; a run whose control is off by more than `CONTROL_TOLERANCE` on
any task, or whose repeats disagree by more than `SPREAD_TOLERANCE` (median relative range), is
noisy, and its goals are "not judged".
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from benchmarks.exactness import counts, describe

# Spec-Bench's six tasks, then HumanEval's "code" (`benchmarks/prompts.py`); tables show the tasks a run has.
TASKS = ["multi-turn conversation", "translation", "summarization", "qa", "math_reasoning", "rag", "code"]
BASELINE, CONTROL = "hf_plain", "hf_control"
CONTROL_TOLERANCE = 0.10  # the control must be within 0.9x-1.1x on every task
SPREAD_TOLERANCE = 0.15  # median over (method, prompt) of (max - min) / median of the repeats' times

DRAFTING = ("ours_sd", "ours_nasd", "ours_hybrid", "ours_self", "ours_self_hybrid")  # our methods that draft, with their default settings
THEIRS = ("hf_assisted", "hf_prompt_lookup")  # transformers' methods that draft
# (mode, workload) -> [(method, or a tuple: the best of them; compared with, or a tuple: the best of them; minimum
# speedup; "overall" or "every task")]: issue 34's goals (HumanEval and Spec-Bench, greedy and sampling at T 0.7,
# top-p 0.9), and issue 51's for greedy decoding (the self-drafter, the best of ours against transformers' best).
GOALS = {
    ("greedy", "spec_bench"): [("ours_ar", BASELINE, 0.97, "overall"), ("ours_nasd", BASELINE, 1.0, "every task"),
                               ("ours_nasd", "hf_prompt_lookup", 1.2, "overall"), ("ours_sd", "hf_assisted", 1.3, "overall"),
                               ("ours_self", "ours_ar", 1.6, "overall"), (DRAFTING, THEIRS, 1.5, "overall"),
                               *((method, "ours_ar", 0.97, "overall") for method in DRAFTING)],
    ("greedy", "humaneval"): [("ours_ar", BASELINE, 0.97, "overall"), (DRAFTING, "hf_prompt_lookup", 1.5, "overall"),
                              ("ours_sd", "hf_assisted", 1.5, "overall"), ("ours_nasd", "hf_prompt_lookup", 1.1, "overall"),
                              *((method, "ours_ar", 0.97, "overall") for method in DRAFTING)],
    ("sampling", "spec_bench"): [("ours_nasd", BASELINE, 1.0, "overall"), ("ours_nasd", BASELINE, 0.95, "every task"),
                                 ("ours_nasd", "hf_prompt_lookup", 1.1, "overall"), ("ours_sd", "hf_assisted", 1.3, "overall")],
    ("sampling", "humaneval"): [("ours_sd", "hf_assisted", 1.3, "overall"), ("ours_nasd", "hf_prompt_lookup", 1.1, "overall")],
}


def geometric_mean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else float("nan")


def tasks_in(summary: dict) -> list[str]:
    """The tasks (in `TASKS` order) that some method of `summary` has figures for."""
    return [task for task in TASKS if any(task in row["tasks"] for row in summary.values())]


def _tokens_per_second(records: list[dict]) -> float:
    """1 / mean over prompts of the median (over the given records) seconds per token."""
    by_prompt: dict[int, list[float]] = defaultdict(list)
    for r in records:
        by_prompt[r["prompt"]].append(r["seconds"] / max(r["tokens"], 1))
    return 1.0 / statistics.fmean(statistics.median(v) for v in by_prompt.values())


def summarise(records: list[dict], methods: list[str]) -> dict:
    """Per method and task: speedup (median over repeats), its min/max over single repeats,
    tokens/s, tau, alpha, verification steps and those that drafted nothing, mismatches (of which
    defects and near-ties), peak memory; per method: the geometric mean over tasks."""
    repeats = sorted({r["repeat"] for r in records})
    summary: dict = {}
    for method in methods:
        rows = {}
        for task in TASKS:
            mine = [r for r in records if r["method"] == method and r["task"] == task]
            base = [r for r in records if r["method"] == BASELINE and r["task"] == task]
            if not mine or not base:
                continue
            per_repeat = [_tokens_per_second([r for r in mine if r["repeat"] == k])
                          / _tokens_per_second([r for r in base if r["repeat"] == k]) for k in repeats]
            taus = [r["tau"] for r in mine if r["tau"] is not None]
            alphas = [r["alpha"] for r in mine if r["alpha"] is not None]
            rows[task] = {
                "speedup": _tokens_per_second(mine) / _tokens_per_second(base),
                "speedup_min": min(per_repeat), "speedup_max": max(per_repeat),
                "tokens_per_s": _tokens_per_second(mine),
                "tau": statistics.fmean(taus) if taus else None,
                "alpha": statistics.fmean(alphas) if alphas else None,
                "steps": sum(r.get("steps") or 0 for r in mine),
                "steps_without_drafts": sum(r.get("steps_without_drafts") or 0 for r in mine),
                "mismatches": sum(not r["matches_reference"] for r in mine),
                **counts([r.get("difference") for r in mine]),
                "peak_rss_mib": max(r["peak_rss_mib"] for r in mine),
            }
        summary[method] = {"tasks": rows, "overall": geometric_mean([row["speedup"] for row in rows.values()])}
    return summary


def noise_verdict(records: list[dict], summary: dict) -> dict:
    """Whether the run can be trusted: the control's speedups and the repeats' spread."""
    spreads = []
    groups: dict[tuple[str, int], list[float]] = defaultdict(list)
    for r in records:
        groups[(r["method"], r["prompt"])].append(r["seconds"] / max(r["tokens"], 1))
    for times in groups.values():
        if len(times) > 1:
            spreads.append((max(times) - min(times)) / statistics.median(times))
    spread = statistics.median(spreads) if spreads else 0.0
    control = {task: row["speedup"] for task, row in summary.get(CONTROL, {"tasks": {}})["tasks"].items()}
    reasons = []
    off = {task: value for task, value in control.items() if abs(value - 1.0) > CONTROL_TOLERANCE}
    if off:
        reasons.append("control (the same work twice) off by more than "
                       f"{CONTROL_TOLERANCE:.0%}: " + ", ".join(f"{t} {v:.2f}x" for t, v in off.items()))
    if spread > SPREAD_TOLERANCE:
        reasons.append(f"repeats disagree: median spread {spread:.0%} > {SPREAD_TOLERANCE:.0%}")
    if CONTROL not in summary:
        reasons.append("no control was run")
    return {"noisy": bool(reasons), "reasons": reasons, "median_spread": spread, "control": control}


def _ratio(summary: dict, method: str, other: str, scope: str) -> float:
    if scope == "overall":
        return summary[method]["overall"] / summary[other]["overall"]
    mine, theirs = summary[method]["tasks"], summary[other]["tasks"]
    return min((mine[t]["speedup"] / theirs[t]["speedup"] for t in mine if t in theirs), default=float("nan"))


def goal_lines(summary: dict, mode: str, verdict: dict, workload: str = "spec_bench") -> list[str]:
    """One line per goal of (mode, workload) whose methods ran: the ratio, and met / NOT met (or not
    judged in a noisy run). A goal over several methods is the best of those that ran, against the best of those
    compared with."""
    def best(names: str | tuple[str, ...]) -> tuple[list[str], str]:
        """The methods of `names` that ran, and how a line names them."""
        ran = [m for m in ((names,) if isinstance(names, str) else names) if m in summary]
        return ran, names if isinstance(names, str) else "best of " + ", ".join(ran)

    lines = []
    for methods, others, minimum, scope in GOALS[(mode, workload)]:
        (ran, name), (theirs, other) = best(methods), best(others)
        if not ran or not theirs:
            continue
        value = max(min(_ratio(summary, method, their, scope) for their in theirs) for method in ran)
        judged = "not judged (noisy run)" if verdict["noisy"] else ("met" if value >= minimum else "NOT met")
        lines.append(f"{name} / {other} ({scope}): {value:.2f}x (goal >= {minimum}x) {judged}")
    return lines


def exactness(summary: dict, method: str) -> dict[str, int]:
    """{"defects", "near_ties"} of a method over its tasks (a mismatch not classified counts as a defect)."""
    rows = summary[method]["tasks"].values()
    near_ties = sum(row.get("near_ties", 0) for row in rows)
    return {"defects": sum(row["mismatches"] for row in rows) - near_ties, "near_ties": near_ties}


def report(summary: dict, methods: list[str], settings: dict, verdict: dict, mode: str) -> str:
    """The Markdown report: the table (median speedup [min-max over repeats]), verdict, goals."""
    tasks_shown = tasks_in({method: summary[method] for method in methods})
    header = "| method | " + " | ".join(tasks_shown) + " | overall | peak RSS (MiB) |"
    lines = [f"Speedup against transformers' plain `generate` ({mode}; tokens/s ratio, median over repeats "
             "[min-max of single repeats]).", "",
             f"Machine: {settings.get('machine')}", "",
             f"Settings: { {k: v for k, v in settings.items() if k not in ('machine', 'cost_table')} }", "",
             f"Cost table in use (pass over 1 + k tokens / one-token pass): {settings.get('cost_table')}", "",
             header, "|" + "---|" * (len(tasks_shown) + 3)]
    for method in methods:
        tasks = summary[method]["tasks"]
        cells = []
        for task in tasks_shown:
            if task not in tasks:
                cells.append("-")
                continue
            row = tasks[task]
            cell = f"{row['speedup']:.2f}x [{row['speedup_min']:.2f}-{row['speedup_max']:.2f}]"
            cells.append(cell + (f" tau {row['tau']:.2f}" if row["tau"] else ""))
        peak = max(row["peak_rss_mib"] for row in tasks.values())
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {summary[method]['overall']:.2f}x | {peak:.0f} |")
    undrafted = []  # a policy that drafted nothing shows here, not only as tau near 1
    for method in methods:
        rows = summary[method]["tasks"].values()
        steps = sum(row.get("steps", 0) for row in rows)
        if steps:
            undrafted.append(f"{method} {sum(row['steps_without_drafts'] for row in rows)} of {steps}")
    differing = [f"{method} {describe(exactness(summary, method))}" for method in methods
                 if summary[method]["tasks"] and sum(row["mismatches"] for row in summary[method]["tasks"].values())]
    if mode == "greedy":
        lines += ["", "Outputs that differ from transformers' greedy output (a near-tie: at the first differing token the "
                  "target's two logits are within the dtype's rounding, benchmarks/exactness.py; anything else is a "
                  "defect): " + ("; ".join(differing) if differing else "none") + "."]
    if undrafted:
        lines += ["", "tau: tokens per verification step of a sequence (the prompt pass excluded). Steps that drafted "
                  "nothing, of all verification steps: " + "; ".join(undrafted) + "."]
    lines += ["", "**NOISY RUN**: " + "; ".join(verdict["reasons"]) if verdict["noisy"]
              else f"Quiet run: control within {CONTROL_TOLERANCE:.0%} on every task, median spread of repeats "
                   f"{verdict['median_spread']:.0%}.", ""]
    lines += [f"- {line}" for line in goal_lines(summary, mode, verdict, settings.get("workload", "spec_bench"))]
    return "\n".join(lines) + "\n"
