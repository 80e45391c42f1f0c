"""Every benchmark behind one command, run from the repository's root.

    python -m benchmarks                          # the benchmarks, each with its docstring's first sentence
    python -m benchmarks spec_bench --help        # one benchmark's flags
    python -m benchmarks spec_bench --per-category 1 --repeats 2

`python -m benchmarks NAME ARGS` is `python -m benchmarks.NAME ARGS`: the same `main(argv)`, the same flags and
outputs. A benchmark is a module of this folder with a `main(argv)` and an `if __name__ == "__main__":` block; the
list is read from the files (their docstrings, by `ast`), so listing imports no model code.
"""

from __future__ import annotations

import ast
import importlib
import shutil
import sys
import textwrap
from pathlib import Path

FOLDER = Path(__file__).resolve().parent
USAGE = "usage: python -m benchmarks NAME [ARGS ...]    (python -m benchmarks NAME --help: its flags)"


def is_entry_point(tree: ast.Module) -> bool:
    """A module with a top-level `main` function and an `if __name__ == "__main__":` block."""
    has_main = any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body)
    runs_as_script = any(isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                         and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"
                         for node in tree.body)
    return has_main and runs_as_script


def summary_line(doc: str | None) -> str:
    """A docstring's first paragraph on one line (a first sentence may wrap over two lines of the source)."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def benchmarks() -> dict[str, str]:
    """name -> one-line description, for every entry point of this folder, in name order."""
    found = {}
    for path in sorted(FOLDER.glob("*.py")):
        if path.stem.startswith("_"):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        if is_entry_point(tree):
            found[path.stem] = summary_line(ast.get_docstring(tree))
    return found


def listing(width: int | None = None) -> str:
    """The usage line, then each benchmark's name and description, wrapped to `width` (default: the terminal's)."""
    found = benchmarks()
    width = width or shutil.get_terminal_size().columns
    column = max(map(len, found)) + 4
    lines = [USAGE, "", "benchmarks:"]
    for name, description in found.items():
        lines += textwrap.wrap(description, max(width, column + 40), initial_indent=f"  {name:<{column - 2}}",
                               subsequent_indent=" " * column, break_on_hyphens=False) or [f"  {name}"]
    return "\n".join(lines)


def run(name: str, argv: list[str]) -> object:
    """`benchmarks.<name>.main(argv)` -> what it returns; argparse's usage lines name the command as typed."""
    program = sys.argv[0]
    sys.argv[0] = f"python -m benchmarks {name}"  # argparse's `prog`: the basename of sys.argv[0]
    try:
        return importlib.import_module(f"benchmarks.{name}").main(argv)
    finally:
        sys.argv[0] = program


def main(argv: list[str] | None = None) -> None:
    """No name (or -h, --help): the list, exit 0; an unknown name: the list on stderr, exit 2; else run it."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(listing())
        return
    name, *rest = argv
    if name not in benchmarks():
        print(f"{listing()}\n\nno benchmark named {name!r}", file=sys.stderr)
        raise SystemExit(2)
    run(name, rest)


if __name__ == "__main__":
    main()
