"""The house's floors only go down (docs/architecture.md): `utils/` imports no package above it,
`sampling/` never imports `ngram_assisted/` (the hybrid reaches NASD's rows through `register_pool`),
and the library's modules import each other in no circle. Every import counts, those inside
functions and under `TYPE_CHECKING` included: each is an arrow a reader has to follow."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("utils", "sampling", "ngram_assisted")
ABOVE = {  # package -> the packages it may never import
    "utils": {"sampling", "ngram_assisted", "console", "benchmarks", "custom_generate"},
    "sampling": {"ngram_assisted", "console", "benchmarks", "custom_generate"},
    "ngram_assisted": {"console", "benchmarks", "custom_generate"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module `path` imports (absolute imports, anywhere in the file)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def library_files() -> list[Path]:
    return sorted(path for package in LIBRARY for path in (ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", LIBRARY)
def test_no_arrow_runs_back_up(package):
    wrong = [f"{path.relative_to(ROOT)} imports {name}" for path in sorted((ROOT / package).rglob("*.py"))
             for name in sorted(imports(path)) if name.split(".")[0] in ABOVE[package]]
    assert not wrong, "\n".join(wrong)


def test_the_library_has_no_import_circle():
    modules = {module_name(path): path for path in library_files()}
    graph = {name: {imported for imported in imports(path) if imported in modules and imported != name}
             for name, path in modules.items()}
    # A package's __init__ hands names on: importing `a.b` runs `a/__init__`, which is not an arrow back.
    graph = {name: {target for target in targets if not name.startswith(target + ".")} for name, targets in graph.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> list[str] | None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                return [*path[path.index(target):], target] if target in path else [name, target]
            if target not in state and (circle := visit(target, [*path, target])):
                return circle
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state and (circle := visit(name, [name])):
            pytest.fail("import circle: " + " -> ".join(circle))


SAMPLING_FLOORS = ("policy", "loop", "drafters")  # from the ground up; the public functions stand above all three


@pytest.mark.parametrize("floor", SAMPLING_FLOORS)
def test_sampling_folders_import_only_down(floor):
    """`sampling/policy/` imports neither the loop nor the kinds, `sampling/loop/` not the kinds, and none of them
    a public function's module (`sampling.speculative`, ...) nor the package's face (`sampling` itself)."""
    below = SAMPLING_FLOORS[: SAMPLING_FLOORS.index(floor) + 1]
    wrong = []
    for path in sorted((ROOT / "sampling" / floor).rglob("*.py")):
        for name in sorted(imports(path)):
            parts = name.split(".")
            if parts[0] == "sampling" and (len(parts) == 1 or parts[1] not in below):
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, "\n".join(wrong)


ARCHITECTURE = ROOT / "docs" / "architecture.md"
BEING_BUILT = ("utils/lean/",)  # named by the page ahead of the other branch's merge: checked once it exists


def named_paths(text: str) -> set[str]:
    """Every repository path the page names: a path with folders (`sampling/loop/drafts.py`, `utils/runners/`)."""
    return set(re.findall(r"(?<![\w./])((?:[a-z_][\w]*/)+(?:[\w]+\.(?:py|md))?)", text))


def test_every_path_the_architecture_page_names_exists():
    text = ARCHITECTURE.read_text()
    missing = [path for path in sorted(named_paths(text))
               if not (ROOT / path).exists() and not (path.startswith(BEING_BUILT) and not (ROOT / "utils" / "lean").exists())]
    files = {path.name for path in ROOT.rglob("*.py") if ".venv" not in path.parts}
    missing += [name for name in sorted(set(re.findall(r"(?<![\w/.])(\w+\.py)\b", text))) if name not in files]
    assert not missing, f"docs/architecture.md names what does not exist: {missing}"


def defined_names() -> set[str]:
    """Every class and module-level name the library, the tests and the page's outside neighbours define."""
    found = set()
    for path in [*library_files(), *sorted((ROOT / "tests").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                found.add(node.name)
            elif isinstance(node, ast.Assign):
                found.update(target.id for target in node.targets if isinstance(target, ast.Name))
    return found


def test_every_class_the_architecture_page_names_exists():
    import builtins

    import torch
    import transformers

    text = ARCHITECTURE.read_text()
    known = defined_names()
    classes = set(re.findall(r"\b[A-Z][a-z0-9]+(?:[A-Z][A-Za-z0-9]*)+\b", text))
    missing = [name for name in sorted(classes)
               if name not in known and not any(hasattr(module, name) for module in (builtins, torch, transformers))]
    assert not missing, f"docs/architecture.md names classes that no module defines: {missing}"


def test_the_architecture_page_states_the_loops_step_order():
    """The page's numbered steps are the loop's numbered comments, in order, by their first word."""
    page = re.findall(r"^ (\d)\. (\w+)", ARCHITECTURE.read_text(), flags=re.MULTILINE)
    loop = re.findall(r"^\s*# (\d)\. (\w+)", (ROOT / "sampling" / "loop" / "speculative_loop.py").read_text(),
                      flags=re.MULTILINE)
    assert [(n, word.lower()) for n, word in page] == [(n, word.lower()) for n, word in loop]
    assert [n for n, _ in loop] == [str(i) for i in range(1, len(loop) + 1)]


def test_the_architecture_page_quotes_the_host_read_ceilings_of_their_test():
    from tests.test_host_reads import CASES

    text = " ".join(ARCHITECTURE.read_text().split())
    for method, (_, ceiling) in CASES.items():
        assert f"{method} {ceiling}" in text, f"docs/architecture.md does not give {method}'s ceiling {ceiling}"
