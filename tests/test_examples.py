"""The notebook tour and the README's Python snippet run as they are, on the built-in model, so
that neither can rot. They use the user's cache, as `make chat` does: the model is converted once.
Marked slow: `make test` runs them; CI's second run (transformers 4.57) does not.

Threads: one, as the rest of the suite (tests/conftest.py; the notebook's kernel inherits
OMP_NUM_THREADS=1). They check that every cell and line runs and what comes out, not speed; one thread
keeps them as fast beside another busy process as on a quiet machine. The pass costs they measure are
cached under the thread count, so a user's own table (`make chat`, on every core) is neither read nor
replaced. Under pytest-xdist (`make test`) both run on one worker, one after the other: the second reads
the pass costs the first measured (one calibration of the built-in model and its bfloat16 copy, not two
at once)."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests import conftest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def user_cache(monkeypatch):
    if conftest.USER_CACHE is None:
        monkeypatch.delenv("SPECDEC_CACHE")
    else:
        monkeypatch.setenv("SPECDEC_CACHE", conftest.USER_CACHE)


@pytest.mark.slow
@pytest.mark.xdist_group("built-in model")
def test_the_tour_notebook_runs_every_cell(user_cache):
    notebook = nbformat.read(ROOT / "examples" / "tour.ipynb", as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and not any(cell.outputs for cell in code), "commit the notebook without outputs"
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = [output for cell in code for output in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the acceptance plot
    assert any("text/html" in o.get("data", {}) for o in outputs)  # the coloured drafts


@pytest.mark.slow
@pytest.mark.xdist_group("built-in model")
def test_the_readme_snippet_runs(user_cache, capsys):
    readme = (ROOT / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", readme, re.DOTALL).group(1)
    exec(compile(snippet, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip()  # it prints the generated text


def test_the_user_cache_is_the_users_under_xdist_too():
    """pytest-xdist's workers inherit the controller's environment, the suite's fresh folder included: the built-in
    model's tests must still see the user's cache folder (tests/conftest.py), not a folder of the suite's."""
    assert conftest.USER_CACHE is None or not Path(conftest.USER_CACHE).name.startswith("specdec-tests-")
