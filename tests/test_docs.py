"""The docs stay true: every public name of the library has a section in docs/api.md that names
each of its parameters (with its default, where it has a simple one), the README stays a short
guide, and every relative link in the README and docs/ points to a file that exists.

Public names: `__all__` of `sampling`, `ngram_assisted` and `utils.logits_processors`, plus
`utils.loading.load_model` and `end_token_ids`. For a class: its constructor's parameters and
every public method, property and attribute it defines, with each method's parameters.
"""

from __future__ import annotations

import enum
import inspect
import re
from pathlib import Path

import pytest

import ngram_assisted
import sampling
import utils.loading
import utils.logits_processors

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api.md"
README_MAX_LINES = 250

PUBLIC = {
    **{name: getattr(sampling, name) for name in sampling.__all__},
    **{name: getattr(ngram_assisted, name) for name in ngram_assisted.__all__},
    **{name: getattr(utils.logits_processors, name) for name in utils.logits_processors.__all__},
    "load_model": utils.loading.load_model,
    "end_token_ids": utils.loading.end_token_ids,
}
SKIPPED_KINDS = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def word(name: str) -> re.Pattern:
    """`name` as a whole identifier (so that `speculative_generate` is not found inside
    `speculative_generate_encoder_decoder`, nor `DynaGram` inside `MultiDynaGram`)."""
    return re.compile(rf"(?<![\w]){re.escape(name)}(?![\w])")


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of every Markdown heading outside code blocks; a body runs to the next
    heading of the same or a higher level, so it includes its subsections."""
    lines, headings, fenced = text.splitlines(), [], False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"(#+)\s+(.*)", line)):
            headings.append((i, len(match.group(1)), match.group(2)))
    found = []
    for j, (i, level, title) in enumerate(headings):
        end = next((k for k, lv, _ in headings[j + 1 :] if lv <= level), len(lines))
        found.append((title, "\n".join(lines[i + 1 : end])))
    return found


def section_of(name: str) -> str:
    """The body of the first heading of docs/api.md that names `name`."""
    for title, body in sections(API.read_text()):
        if word(name).search(title):
            return body
    pytest.fail(f"docs/api.md has no heading naming {name}")


def parameters(function) -> list[inspect.Parameter]:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return []
    return [p for p in signature.parameters.values() if p.name not in ("self", "cls") and p.kind not in SKIPPED_KINDS]


def members(cls: type) -> dict[str, object]:
    """The public methods, properties and attributes a class defines itself (annotations included)."""
    own = {name: value for name, value in vars(cls).items() if not name.startswith("_")}
    for name in vars(cls).get("__annotations__", {}):
        if not name.startswith("_"):
            own.setdefault(name, None)
    return own


def documented(name: str, body: str) -> bool:
    """Whether the section writes `name` in code (`name`, `name=...`, `name(...)`, `Owner.name`)."""
    return re.search(rf"`(?:\w+\.)?{re.escape(name)}(?![\w])", body) is not None


def default_text(default: object) -> str | None:
    """What the docs must show as a parameter's default, where it has a simple one."""
    if default is inspect.Parameter.empty:
        return None
    if isinstance(default, enum.Enum):
        return default.name
    if repr(default) == "<factory>":  # a dataclass field's default_factory: the docs say what it makes
        return None
    if inspect.isfunction(default):
        return default.__name__
    if default is None or isinstance(default, (bool, int, float, str, tuple)):
        return repr(default)
    return type(default).__name__  # e.g. GreedyProcessor()


def check_parameters(owner: str, function, body: str, problems: list[str]) -> None:
    lines = body.splitlines()
    for parameter in parameters(function):
        rows = [line for line in lines if documented(parameter.name, line)]
        if not rows:
            problems.append(f"{owner}: parameter `{parameter.name}` is not in its section of docs/api.md")
            continue
        default = default_text(parameter.default)
        if default is not None and not any(word(default).search(row) or default in row for row in rows):
            problems.append(f"{owner}: parameter `{parameter.name}`'s default {default} is not on a line naming it")


def check_method(owner: str, member: str, function, body: str, problems: list[str]) -> None:
    """A method is documented by its call written in code, `member(a, b=default)`: each parameter
    named in it, each simple default as `name=default`."""
    calls = [span for span in re.findall(r"`([^`]*)`", body) if re.match(rf"(?:\w+\.)?{re.escape(member)}\(", span)]
    for parameter in parameters(function):
        if not any(word(parameter.name).search(call) for call in calls):
            problems.append(f"{owner}.{member}: parameter `{parameter.name}` is not in a `{member}(...)` of its section")
            continue
        default = default_text(parameter.default)
        if default is not None and not any(f"{parameter.name}={default}" in call for call in calls):
            problems.append(f"{owner}.{member}: write `{parameter.name}={default}` in its `{member}(...)`")


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_every_public_name_and_parameter_is_in_the_api_reference(name):
    obj, body, problems = PUBLIC[name], section_of(name), []
    check_parameters(name, obj, body, problems)
    if inspect.isclass(obj):
        for member, value in members(obj).items():
            if not documented(member, body):
                problems.append(f"{name}.{member} is not in the section of {name} in docs/api.md")
            function = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
            if inspect.isfunction(function):
                check_method(name, member, function, body, problems)
    assert not problems, "\n".join(problems)


def test_the_api_reference_defines_alpha_tau_and_every_stats_field():
    body = section_of("SpeculativeStats")
    for field in ("alpha", "tau", *(p.name for p in parameters(sampling.SpeculativeStats))):
        assert documented(field, body), f"SpeculativeStats.{field} is not defined in docs/api.md"
    text = API.read_text()
    assert "length penalty" in text and "acceptance rate" in text  # the two meanings of alpha, said apart


def test_the_readme_is_a_short_guide():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < README_MAX_LINES, f"README.md has {len(lines)} lines; the rest belongs in docs/"


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def relative_links(text: str) -> list[str]:
    """The targets of the Markdown links outside code blocks that point into the repository."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:|#", t)]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_points_to_a_file(path):
    broken = [target for target in relative_links(path.read_text())
              if not (path.parent / target.split("#")[0]).exists()]
    assert not broken, f"{path.relative_to(ROOT)} links to missing files: {broken}"


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_keyword_only_parameters_are_marked_so(name):
    """A parameter after `*` is marked "(keyword)" on a line of its section that names it; one that
    may be passed by position is not (a user copies the table's order)."""
    body = section_of(name)
    for parameter in parameters(PUBLIC[name]):
        rows = [line for line in body.splitlines() if line.startswith(f"| `{parameter.name}` |")]
        marked = any("(keyword)" in row.split("|")[2] for row in rows)
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY:
            assert marked, f"{name}: keyword-only parameter `{parameter.name}` is not marked (keyword) in docs/api.md"
        elif rows:
            assert not marked, f"{name}: `{parameter.name}` may be passed by position but is marked (keyword)"
