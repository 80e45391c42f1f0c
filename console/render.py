"""What the console prints: a debug step coloured by origin, its legend, the results and the status tables."""

from __future__ import annotations

from dataclasses import dataclass

from rich import box
from rich.table import Table
from rich.text import Text

from sampling import SpeculativeStats, Step

# The debug view's colours. Rejected drafts are also struck through, and bracketed, so that the
# line still reads where a terminal shows no strikethrough.
ACCEPTED, REJECTED, TARGET = "green", "red strike", "blue"


def legend() -> Text:
    """One line naming the debug view's colours, each in its own colour."""
    text = Text("colours: ")
    text.append("accepted drafts", style=ACCEPTED)
    text.append(", ")
    text.append("[rejected drafts]", style=REJECTED)
    text.append(" (dropped), ")
    text.append("the target's own token", style=TARGET)
    return text


def render_step(step: Step, tokenizer) -> Text:
    """Debug view of one step: accepted drafts green, rejected drafts (the rest of the chain, or the
    other branches of a tree) red, struck and in brackets, the target's own token blue."""
    text = Text()
    for token in step.tokens[: step.accepted]:
        text.append(tokenizer.decode([token]), style=ACCEPTED)
    rejected = step.drafts[step.accepted :]
    if rejected:
        text.append("[" + "".join(tokenizer.decode([token]) for token in rejected) + "]", style=REJECTED)
    if len(step.tokens) > step.accepted:
        text.append(tokenizer.decode([step.tokens[-1]]), style=TARGET)
    return text


@dataclass
class Result:
    """One method's answer to a prompt."""

    method: str
    ids: list[int]
    seconds: float
    stats: SpeculativeStats | None
    text: str = ""  # the ids decoded
    prior_costs: bool = False  # drafted on the prior pass costs, not on ones measured on this machine

    @property
    def tokens_per_second(self) -> float:
        return len(self.ids) / self.seconds if self.seconds > 0 else 0.0


def results_table(results: list[Result]) -> tuple[Table, str | None]:
    """The methods side by side -> (table, a footnote or None). The speed column is tokens/s against
    the target's plain decoding: for a method with the target's very output that is the speedup;
    for one whose output differs (beam search, unseeded sampling) it compares speeds only, and the
    footnote says so. A method that drafted on prior pass costs (not measured here: the machine was
    busy while measuring, or measuring is off) is marked `~` beside its speed, and the footnote
    says so: its draft sizes were not chosen for this machine."""
    target = next((r for r in results if r.method == "target"), None)
    # tau: tokens per verification step (SpeculativeStats.tau); undrafted: steps without drafts, of all steps.
    table = Table("method", "tokens", "time (s)", "tokens/s", "alpha", "tau", "undrafted", "vs target",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)  # fits 80 columns
    for r in results:
        ratio = "-"
        if target is not None and r is not target and target.tokens_per_second > 0:
            ratio = f"{r.tokens_per_second / target.tokens_per_second:.2f}x" + ("*" if r.ids != target.ids else "")
            ratio += "~" if r.prior_costs else ""
        table.add_row(r.method, str(len(r.ids)), f"{r.seconds:.2f}", f"{r.tokens_per_second:.1f}",
                      f"{r.stats.alpha:.2f}" if r.stats else "-", f"{r.stats.tau:.2f}" if r.stats else "-",
                      f"{r.stats.steps_without_drafts}/{r.stats.steps}" if r.stats else "-", ratio)
    differ = [f"{r.method} ({len(r.ids)} tokens)" for r in results
              if target is not None and r is not target and r.ids != target.ids]
    notes = []
    if differ:
        notes.append(f"* output differs from the target's ({len(target.ids)} tokens): {', '.join(differ)}; "
                     "'vs target' compares tokens/s, not the time to the same answer")
    prior = [r.method for r in results if r.prior_costs]
    if prior:
        notes.append(f"~ {', '.join(prior)}: drafted on prior pass costs, not measured on this machine (it was busy "
                     "while measuring, or SPECDEC_CALIBRATE=0): draft sizes and kernels not fitted here; measured "
                     "at the next start on a quiet machine")
    return table, "\n".join(notes) or None


def same_tokens_line(results: list[Result], skip: set[str] = frozenset()) -> str | None:
    """Which methods produced the target's very tokens (meaningful when greedy, or seeded: coupled
    sampling); methods in `skip` (a drafter with another vocabulary) compare their text instead."""
    target = next((r for r in results if r.method == "target"), None)
    if target is None:
        return None
    def same(r: Result) -> bool:
        return r.text == target.text if r.method in skip else r.ids == target.ids

    verdicts = [f"{r.method} {'yes' if same(r) else 'no'}" for r in results if r.method not in ("target", "beam")]
    return "same tokens as target: " + ", ".join(verdicts) if verdicts else None


def status_table(rows: dict) -> Table:
    table = Table(show_header=False, box=None)
    for key, value in rows.items():
        table.add_row(key, str(value))
    return table
