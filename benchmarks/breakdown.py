"""Where a generation's time goes: the models' forward passes (counted and timed by hooks, for every
method, transformers' included) and, for our speculative methods, the loop's phases
(`SpeculativeStats(timed=True).seconds`).

Per method, over all its records:
- `tau`: generated tokens / the target's passes after the prefill (one pass per step, for every
  method alike: transformers' prompt lookup and assisted generation included);
- `outside_share`: the share of the wall time spent outside every model's forward pass (sampling,
  acceptance, cache rollback, pools, Python), and `outside_ms_per_step` the same per step;
- `phases_ms_per_step` (ours): "prefill", "draft", "target", "accept", "rollback", "update", "rest".
"""

from __future__ import annotations

import time

import torch

from utils.lean import lean_decoder

PHASES = ("prefill", "draft", "target", "accept", "rollback", "update", "rest")


class ForwardMeter:
    """Counts and times the forward passes of named models while the block runs, by forward pre- and
    post-hooks on each (a model given under two names is hooked once, under the first). On an
    accelerator each hook waits for the queued work first, so that the time is the pass's."""

    def __init__(self, **models) -> None:
        self.models: dict[str, torch.nn.Module] = {}
        for name, model in models.items():
            if model is not None and all(model is not seen for seen in self.models.values()):
                self.models[name] = model
        self.passes = dict.fromkeys(self.models, 0)
        self.seconds = dict.fromkeys(self.models, 0.0)
        self._handles: list = []

    def __enter__(self) -> ForwardMeter:
        for name, model in self.models.items():
            sync = next(model.parameters()).device.type not in ("cpu", "meta")
            started: list[float] = []

            def before(module, args, sync=sync, started=started):
                if sync:
                    torch.accelerator.synchronize()
                started.append(time.perf_counter())

            def after(module, args, output, name=name, sync=sync, started=started):
                if sync:
                    torch.accelerator.synchronize()
                self.passes[name] += 1
                self.seconds[name] += time.perf_counter() - started.pop()

            # transformers' passes run the model, ours our own forward where it covers the model
            for runs in (model, lean_decoder(model)):
                if runs is not None:
                    self._handles += [runs.register_forward_pre_hook(before), runs.register_forward_hook(after)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def record(self) -> dict:
        """{"target_passes", "drafter_passes", "forward_seconds"} of the block."""
        return {"target_passes": self.passes.get("target", 0), "drafter_passes": self.passes.get("drafter", 0),
                "forward_seconds": sum(self.seconds.values())}


def summarise(records: list[dict], methods: list[str]) -> dict:
    """method -> {tau, steps, target_passes, drafter_passes, ms_per_step, outside_share,
    outside_ms_per_step, phases_ms_per_step (ours, else None)}, over every record of the method
    that has the meter's fields (`ForwardMeter.record`, plus "tokens", "seconds", "phases")."""
    out = {}
    for method in methods:
        mine = [r for r in records if r["method"] == method and r.get("target_passes") is not None]
        steps = sum(max(r["target_passes"] - 1, 1) for r in mine)  # the prefill is not a step
        if not mine:
            continue
        seconds = sum(r["seconds"] for r in mine)
        outside = seconds - sum(r["forward_seconds"] for r in mine)
        phases = [r["phases"] for r in mine if r.get("phases")]
        ours_steps = sum(r["steps"] or 0 for r in mine if r.get("phases"))
        out[method] = {
            "tau": sum(r["tokens"] for r in mine) / steps, "steps": steps,
            "target_passes": sum(r["target_passes"] for r in mine), "drafter_passes": sum(r["drafter_passes"] for r in mine),
            "ms_per_step": 1000 * seconds / steps, "outside_share": outside / seconds if seconds else 0.0,
            "outside_ms_per_step": 1000 * outside / steps,
            "phases_ms_per_step": {phase: 1000 * sum(p.get(phase, 0.0) for p in phases) / max(ours_steps, 1)
                                   for phase in PHASES} if phases else None,
        }
    return out


def comparisons(breakdown: dict, pairs: list[tuple[str, str, str]]) -> list[str]:
    """One line per (ours, theirs, note) present: tau and time outside the forward passes per step."""
    lines = []
    for ours, theirs, note in pairs:
        if ours in breakdown and theirs in breakdown:
            a, b = breakdown[ours], breakdown[theirs]
            ratio = a["outside_ms_per_step"] / b["outside_ms_per_step"] if b["outside_ms_per_step"] > 0 else float("nan")
            lines.append(f"{ours} / {theirs} ({note}): tau {a['tau']:.2f} vs {b['tau']:.2f}; outside the forward passes "
                         f"{a['outside_ms_per_step']:.1f} vs {b['outside_ms_per_step']:.1f} ms per step ({ratio:.2f}x), "
                         f"{a['outside_share']:.1%} vs {b['outside_share']:.1%} of the time")
    return lines


def report_lines(breakdown: dict, pairs: list[tuple[str, str, str]]) -> list[str]:
    """The report's section: one table row per method, then the comparisons."""
    if not breakdown:
        return []
    lines = ["", "Where the time goes (all prompts and repeats; a step is one target pass after the prefill; "
             "phases: ms per step of our loop, `SpeculativeStats.seconds`):", "",
             "| method | tau | target passes | drafter passes | ms/step | outside forward | outside ms/step | "
             + " | ".join(PHASES) + " |", "|---|" + "---|" * (6 + len(PHASES))]
    for method, row in breakdown.items():
        phases = row["phases_ms_per_step"]
        cells = [f"{phases[p]:.1f}" for p in PHASES] if phases else ["-"] * len(PHASES)
        lines.append(f"| {method} | {row['tau']:.2f} | {row['target_passes']} | {row['drafter_passes']} | "
                     f"{row['ms_per_step']:.1f} | {row['outside_share']:.1%} | {row['outside_ms_per_step']:.1f} | "
                     + " | ".join(cells) + " |")
    lines += [""] + [f"- {line}" for line in comparisons(breakdown, pairs)]
    return lines
