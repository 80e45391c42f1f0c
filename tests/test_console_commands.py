"""The console's commands in-process (no terminal): parsers, one-line errors, the drafter offer, the report."""

import io

import pytest
from rich.console import Console

from console.app import ChatConsole
from console.commands import COMMANDS, help_text
from console.models import Model, drafter_hint, load, other_tokenizers_supported
from console.render import Result, legend, render_step, results_table
from console.settings import Settings, parse_count, parse_processor, parse_seed, parse_switch
from sampling import SpeculativeStats, Step
from tests.saved_model import save_tiny_chat_model

PAIR = ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture
def app(model_dir, monkeypatch):
    monkeypatch.setenv("SPECDEC_CALIBRATE", "0")  # `/load` measures nothing
    console = Console(file=io.StringIO(), width=200)
    return ChatConsole(load(str(model_dir), {}, console), None, console)


def run(app, line: str) -> str:
    """The command's output (ANSI-free: the test console writes to a file)."""
    out = app.console.file
    out.seek(0)
    out.truncate()
    assert app.command(line)
    return out.getvalue()


def test_value_parsers():
    assert parse_switch(True, [], "ngram") is False
    assert parse_switch(True, ["on"], "ngram") is True
    assert parse_switch(False, ["OFF"], "ngram") is False
    assert parse_count(["16"], "length") == 16
    assert parse_seed(["7"]) == 7
    assert parse_seed(["off"]) is None and parse_seed(["none"]) is None
    assert parse_processor(["nucleus", "0.7", "top_p=0.9"]) == ("nucleus", {"temperature": 0.7, "top_p": 0.9})
    for parse, args in [(parse_switch, (True, ["extra"], "ngram")), (parse_count, (["0"], "gamma")),
                        (parse_seed, (["-1"],)), (parse_processor, (["banana"],)), (parse_processor, ([],)),
                        (parse_processor, (["topk", "0.8", "0.9"],)), (parse_processor, (["colour=blue"],))]:
        with pytest.raises(ValueError) as error:
            parse(*args)
        assert "\n" not in str(error.value)


def test_greedy_shows_as_greedy():
    s = Settings()
    assert s.processor_label == "greedy"
    s.processor_spec = parse_processor(["nucleus", "0.7", "0.9"])
    assert s.processor_label == "NucleusProcessor(temperature=0.7, top_p=0.9)"


def test_errors_are_one_line_and_nothing_escapes(app, monkeypatch):
    for line in ["/processor banana", "/processor nucleus 0.7 1.5", "/ngram extra", "/seed x", "/length",
                 "/set_ngram simple 1", "/load target", "/nonsense", "/status please"]:
        output = run(app, line)
        assert output.count("\n") == 1, (line, output)
    def broken(app, args):
        raise RuntimeError("boom")
    monkeypatch.setitem(COMMANDS, "/clear", type(COMMANDS["/clear"])("/clear", "", broken))
    assert "/clear failed: RuntimeError: boom" in run(app, "/clear")


def test_switches_honour_their_argument(app):
    assert "ngram: off" in run(app, "/ngram off") and app.settings.methods["ngram"] is False
    assert "ngram: off" in run(app, "/ngram off")
    assert "ngram: on" in run(app, "/ngram") and app.settings.methods["ngram"] is True
    assert "usage: /ngram [on|off]" in run(app, "/ngram extra") and app.settings.methods["ngram"] is True
    assert "cache: off" not in run(app, "/cache on") and app.settings.use_cache is True
    run(app, "/seed 3")
    assert "seed: off" in run(app, "/seed off") and app.settings.seed is None


def test_debug_prints_its_legend(app):
    output = run(app, "/debug on")
    assert all(part in output for part in ("accepted drafts", "rejected drafts", "the target's own token"))
    assert "accepted drafts" in legend().plain


def test_help_tells_speculative_and_drafter_apart_and_how_to_get_a_drafter(app):
    lines = help_text(app).splitlines()
    speculative = next(line for line in lines if line.startswith("/speculative"))
    drafter = next(line for line in lines if line.startswith("/drafter"))
    own = next(line for line in lines if line.startswith("/self"))
    assert "verifies" in speculative and "alone" in drafter and "four bits" in own and "no second model" in own
    assert "make models" in lines[-1]


def test_the_drafter_offer():
    built_in, coder = Model(None, None, None), Model(None, None, "qwen2.5-coder-1.5b")  # an alias of the short name
    assert "make models" in drafter_hint(built_in, installed=[])
    assert "/load target qwen2.5-coder-1.5b-instruct" in drafter_hint(built_in, installed=PAIR)
    assert "/load drafter qwen2.5-coder-0.5b-instruct" in drafter_hint(coder, installed=PAIR)
    assert "not installed: run make models" in drafter_hint(coder, installed=PAIR[1:])
    for installed in ([], PAIR):  # no real drafter for the built-in model: the stand-in is offered, and said what it is
        assert "/load drafter stand-in" in drafter_hint(built_in, installed=installed)
        assert "bfloat16 copy of the target" in drafter_hint(built_in, installed=installed)


def test_speculative_offers_the_stand_in_and_it_keeps_the_targets_tokens(app):
    import torch

    output = run(app, "/speculative on")
    assert "/load drafter stand-in" in output and "bfloat16 copy" in output and output.count("\n") == 1
    output = run(app, "/load drafter stand-in")
    assert "(/speculative on)" in output and "bfloat16 copy of the target" in output and "no speed-up" in output
    assert app.drafter.model.dtype == torch.bfloat16 and app.drafter.tokenizer is app.target.tokenizer
    assert app.drafter.model is not app.target.model and app.target.model.dtype == torch.float32
    run(app, "/length 8")
    app.answer("w5 w6 w7 w5 w6")
    assert "same tokens as target: speculative yes" in app.console.file.getvalue()


def test_a_run_on_prior_costs_says_so_beside_the_speed(app):
    results = [Result("target", [1, 2, 3, 4], 2.0, None), Result("ngram", [1, 2, 3, 4], 1.0, SpeculativeStats(), prior_costs=True)]
    table, footnote = results_table(results)
    console = Console(file=io.StringIO(), width=120)
    console.print(table)
    assert "2.00x~" in console.file.getvalue() and "~ ngram: drafted on prior pass costs" in footnote
    run(app, "/length 4")  # the fixture switches measuring off (SPECDEC_CALIBRATE=0): the costs are the prior
    app.answer("w5 w6 w7")
    assert "drafted on prior pass costs, not measured on this machine" in app.console.file.getvalue()


def test_the_first_load_message_fits_the_model():
    from console.models import first_load_message
    from utils.offline_models import OFFLINE_MODELS

    built_in = first_load_message(OFFLINE_MODELS["smollm2-135m-instruct"])
    assert "a few minutes" not in built_in and "98 MB" in built_in  # it took 22 s on a quiet 2-core machine
    assert "a few minutes" in first_load_message(OFFLINE_MODELS["qwen2.5-coder-1.5b-instruct"])


def test_the_console_modules_import_no_circle():
    """No module of console/ imports, even for type checking only, one that imports it back (issue 35)."""
    import ast
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "console"
    graph = {}
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text())
        graph[path.stem] = {node.module.split(".")[1] for node in ast.walk(tree)
                            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("console.")}

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n))) for n in graph.get(start, ()))

    assert not [m for m in graph if reaches(m, m)], graph


def test_speculative_needs_a_drafter_and_load_brings_one(app, model_dir):
    assert "/speculative needs a drafter model" in run(app, "/speculative on")
    assert app.settings.methods["speculative"] is False
    assert "could not load" in run(app, f"/load drafter {model_dir / 'missing'}")
    assert "(/speculative on)" in run(app, f"/load drafter {model_dir}")
    run(app, "/length 8")
    output = run(app, "/drafter on")
    assert "drafter: on" in output
    app.answer("w5 w6 w7 w5 w6")
    output = app.console.file.getvalue()
    assert "same tokens as target: speculative yes, drafter yes, ngram yes" in output


def test_self_drafts_for_the_target_and_keeps_its_tokens(app):
    assert app.settings.methods["self"] is False  # off by default: its four-bit copy takes seconds to build
    output = run(app, "/self on")
    assert "four-bit copy" in output and output.endswith("self: on\n") and app.target.four_bit is not None
    assert "four-bit copy" not in run(app, "/self on")  # built once per target
    run(app, "/length 8")
    app.answer("w5 w6 w7 w5 w6")
    output = app.console.file.getvalue()
    assert "[self]" in output and "same tokens as target: self yes, ngram yes" in output
    assert app.prior_costs("self")  # the fixture measures nothing: the four-bit copy drafted on the prior costs too
    run(app, "/ngram off")
    run(app, "/debug on")
    app.answer("w8 w9 w5 w6")  # self alone drafts: its steps are coloured, the legend says how
    assert "accepted drafts" in app.console.file.getvalue().split("/debug")[-1]
    assert "self: off" in run(app, "/self off") and app.settings.methods["self"] is False


def test_self_is_refused_on_an_encoder_decoder_target(app):
    import torch

    from tests.models import tiny_model

    run(app, "/self on")
    t5 = Model(tiny_model("t5", dtype=torch.float32), app.target.tokenizer, "tiny-t5")
    note = app.set_target(t5)  # what /load target does: /self goes off, and the note says why
    assert "self: off (/self drafts for decoder-only targets: tiny-t5 is an encoder-decoder model)" in note
    assert app.settings.methods["self"] is False
    output = run(app, "/self on")
    assert output == "/self drafts for decoder-only targets: tiny-t5 is an encoder-decoder model\n"
    assert app.settings.methods["self"] is False and "supports decoder-only" in run(app, "/beam on")


def test_a_drafter_with_another_tokenizer_loads_in_one_line_and_keeps_the_targets_tokens(app, tmp_path):
    other = save_tiny_chat_model(tmp_path / "other", vocab=80)  # word-level, another vocabulary
    output = run(app, f"/load drafter {other}")
    assert output.count("\n") == 1
    if not other_tokenizers_supported():
        assert "does not share the tokenizer" in output and app.drafter is None
        return
    assert "(/speculative on)" in output and app.drafter is not None  # judged on the texts in play, not at load
    run(app, "/length 8")
    app.answer("w5 w6 w7 w5 w6")
    assert "same tokens as target: speculative yes" in app.console.file.getvalue()


def test_the_report_says_when_outputs_differ():
    stats = SpeculativeStats()
    results = [Result("target", [1, 2, 3, 4], 2.0, None), Result("ngram", [1, 2, 3, 4], 1.0, stats),
               Result("beam", [5, 6], 2.0, None)]
    table, footnote = results_table(results)
    console = Console(file=io.StringIO(), width=120)
    console.print(table)
    text = console.file.getvalue()
    assert "2.00x" in text and "0.50x*" in text  # ngram: same output twice as fast; beam: half the tokens/s
    assert "beam (2 tokens)" in footnote and "compares tokens/s" in footnote
    assert results_table(results[:2])[1] is None


class _Words:
    def decode(self, ids):
        return "".join(f" t{i}" for i in ids)


def test_rejected_drafts_read_without_strikethrough():
    step = Step(tokens=[1, 2, 9], drafts=[1, 2, 3, 4], accepted=2)
    assert render_step(step, _Words()).plain == " t1 t2[ t3 t4] t9"


def test_a_drafter_in_another_vocabulary_is_compared_by_text():
    from console.render import same_tokens_line

    results = [Result("target", [1, 2], 1.0, None, "a b"), Result("drafter", [7, 8, 9], 1.0, None, "a b")]
    assert same_tokens_line(results) == "same tokens as target: drafter no"
    assert same_tokens_line(results, skip={"drafter"}) == "same tokens as target: drafter yes"
