"""Drive the real console through a pseudo-terminal, as a user would."""

import io
import shutil
import signal
import sys
import time
from pathlib import Path

import pexpect
import pytest

from tests.saved_model import save_tiny_chat_model

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "> "
pytestmark = pytest.mark.subprocess  # each test starts infer.py: left out of `make test-fast`


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


def start(model_dir, *extra):
    # 120 s: two cores shared with other jobs import PyTorch and transformers slowly
    child = pexpect.spawn(sys.executable, [str(ROOT / "infer.py"), "--target", str(model_dir), *extra],
                          cwd=str(ROOT), encoding="utf-8", timeout=120, dimensions=(50, 200))
    child.expect_exact("/help for the commands")
    child.expect_exact(PROMPT)
    return child


def send(child, line, *expected):
    child.sendline(line)
    for text in expected:
        child.expect_exact(text)
    child.expect_exact(PROMPT)


def test_commands_and_bad_values(model_dir):
    child = start(model_dir)
    send(child, "/help", "/speculative", "the drafter model drafts", "/self", "drafts for itself", "/drafter", "the drafter model alone",
         "/processor <name>", "make models")
    send(child, "/status", "methods", "processor")
    for toggle, name in [("/debug", "debug"), ("/cache", "use_cache"), ("/chat", "chat"),
                         ("/stop_if_unknown", "stop_if_unknown"), ("/reset_in_between", "reset_in_between"),
                         ("/beam", "beam"), ("/ngram", "ngram"), ("/target", "target")]:
        send(child, toggle, f"{name}: ")
    send(child, "/speculative", "needs a drafter model")
    send(child, "/drafter", "needs a drafter model")
    send(child, "/ngram off", "ngram: off")
    send(child, "/ngram off", "ngram: off")  # the argument sets, it does not flip
    send(child, "/ngram on", "ngram: on")
    send(child, "/ngram extra", "usage: /ngram [on|off], got 'extra'")
    send(child, "/debug on", "debug: on", "accepted drafts", "rejected drafts", "the target's own token")
    send(child, "/debug off", "debug: off")
    send(child, "/length 16", "max_gen_len: 16")
    send(child, "/length -3", "usage: /length <n>")
    send(child, "/length abc", "usage: /length <n>")
    send(child, "/gamma 0", "usage: /gamma <n>")
    send(child, "/gamma 3", "gamma: 3")
    send(child, "/gamma 1000", "usage: /gamma <n>, n an integer from 1 to 31")
    send(child, "/length 5000", "from 1 to 4096 (the model's context)")
    send(child, "/seed 7", "seed: 7")
    send(child, "/seed off", "seed: off")
    send(child, "/status", "seed              off")
    send(child, "/top_k_filler 2", "top_k_filler: 2")
    send(child, "/top_k_filler 100000", "at most the vocabulary size")
    send(child, "/processor nucleus 0.7 0.9", "NucleusProcessor(temperature=0.7, top_p=0.9)")
    send(child, "/processor topk 0.8 40", "TopKProcessor(temperature=0.8, top_k=40)")
    send(child, "/processor topknucleus 0.8 40 0.9", "TopKNucleusProcessor(temperature=0.8, top_k=40, top_p=0.9)")
    send(child, "/processor nucleus temperature=0.7 top_p=0.8", "NucleusProcessor(temperature=0.7, top_p=0.8)")
    send(child, "/processor topk 0.8 0.9", "top_k must be an integer, got '0.9'")
    send(child, "/processor nucleus 0.8 10 0.9", "nucleus takes temperature, top_p, got 3 values")
    send(child, "/processor nucleus top_k=3", "nucleus has no parameter 'top_k'")
    send(child, "/processor nucleus 0.7 1.5", "top_p must be in (0, 1]")
    send(child, "/processor nucleus 0", "temperature must be")
    send(child, "/processor banana", "unknown processor 'banana': greedy, multinomial")
    send(child, "/processor greedy", "processor: greedy\r\n")
    send(child, "/processor repetition_penalty=1.2 no_repeat_ngram_size=3 min_p=0.05",
         "TransformersProcessor([", "do_sample=True)")  # 4.57's config adds top_k=50, as its generate does
    send(child, "/processor colour=blue", "unknown setting")
    send(child, "/processor repetition_penalty=much", "repetition_penalty must be a number")
    send(child, "/processor repetition_penalty=-1", "repetition_penalty must be > 0 (1: off), got -1")
    send(child, "/branching 2", "branching: 2")
    send(child, "/branching 0", "usage: /branching")
    send(child, "/branching auto", "branching: auto")
    send(child, "/set_ngram simple 4", "SimpleDynaGram(n=4")
    send(child, "/set_ngram simple 1", "usage: /set_ngram")
    send(child, "/clear", "conversation cleared")
    send(child, "/nonsense", "unknown command /nonsense")
    child.sendline("/quit")
    child.expect_exact("bye")
    child.expect(pexpect.EOF)


def test_chat_of_two_turns_compares_methods(model_dir):
    child = start(model_dir)
    send(child, "/length 12")
    send(child, "/beam")
    send(child, "w5 w6 w7 w5 w6", "[target]", "[ngram]", "[beam]", "tokens/s", "vs target",
         "output differs from the target's", "beam", "compares tokens/s",
         "same tokens as target: ngram yes")  # greedy
    send(child, "/debug")
    send(child, "w8 w9 w5 w6", "[target]", "[ngram]", "tau")
    send(child, "/processor repetition_penalty=1.3 no_repeat_ngram_size=2")
    send(child, "/branching 3")
    send(child, "w5 w6 w7 w5 w6 w7", "[target]", "[ngram]", "tau")
    send(child, "/status", "turns in history  3")
    send(child, "/processor nucleus 1.5 0.95")
    send(child, "/seed 3")
    send(child, "w5 w6 w7", "[target]", "[ngram]", "same tokens as target: ngram yes")  # seeded: coupled sampling
    send(child, "/seed off", "seed: off")
    send(child, "w5 w6", "[target]", "[ngram]", "tau")  # unseeded sampling
    child.sendeof()  # Ctrl-D exits
    child.expect_exact("bye")
    child.expect(pexpect.EOF)


def test_a_drafter_model_runs_speculative_decoding(model_dir):
    child = start(model_dir, "--drafter", str(model_dir))  # the tiny model drafting for itself: all accepted
    send(child, "/length 12")
    send(child, "/status", "drafter", str(model_dir), "methods           target, speculative, ngram")
    send(child, "/drafter on", "drafter: on")
    send(child, "/self on", "four-bit copy", "self: on")  # and the target drafting for itself in four bits
    send(child, "w5 w6 w7 w5 w6", "[target]", "[speculative]", "[self]", "[drafter]", "[ngram]",
         "same tokens as target: speculative yes, self yes, drafter yes, ngram yes")
    send(child, "/load drafter " + str(model_dir / "missing"), "could not load")
    child.sendline("/quit")
    child.expect(pexpect.EOF)


def test_ctrl_c_stops_a_generation_and_returns_to_the_prompt(model_dir):
    child = start(model_dir)
    send(child, "/length 4000")
    child.sendline("w5 w6 w7")
    child.expect_exact("[target]")
    time.sleep(0.1)  # the tiny model says all it has to say (~165 tokens) in about half a second
    child.kill(signal.SIGINT)
    child.expect_exact("[generation stopped]")
    child.expect_exact(PROMPT)
    send(child, "/status", "length")
    child.sendline("/quit")
    child.expect(pexpect.EOF)


def test_ctrl_c_at_an_idle_prompt_exits_with_status_0(model_dir):
    child = start(model_dir)
    child.sendintr()  # the terminal's Ctrl-C
    child.expect_exact("bye")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0 and child.signalstatus is None


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed here")
def test_ctrl_c_at_the_prompt_of_make_chat_ends_make_with_status_0(model_dir, tmp_path):
    """GNU make gets the terminal's SIGINT too, waits for the console, then kills itself with it (signal 2)
    unless the console took the terminal for its own process group (console/terminal.py: own_ctrl_c)."""
    (tmp_path / "Makefile").write_text(f"chat:\n\t{sys.executable} {ROOT / 'infer.py'} --target {model_dir}\n")
    child = pexpect.spawn("make", ["-s", "-C", str(tmp_path), "chat"], cwd=str(ROOT), encoding="utf-8", timeout=120,
                          dimensions=(50, 200))
    child.expect_exact("/help for the commands")
    child.expect_exact(PROMPT)
    child.sendintr()
    child.expect_exact("bye")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0 and child.signalstatus is None


def test_keys_typed_during_a_generation_are_neither_shown_nor_kept(model_dir):
    child = start(model_dir)
    child.logfile_read = seen = io.StringIO()  # everything the console shows from here on
    send(child, "/length 200")
    send(child, "/beam")  # target, ngram, then beam search: a second or so after the first tokens
    child.sendline("w5 w6 w7")
    child.expect_exact("[target]")
    child.send("zzz typed meanwhile\r")
    child.expect_exact("tokens/s")  # the report: every method has finished
    child.expect_exact(PROMPT)
    send(child, "/status", "turns in history  1")  # the typed line did not become a prompt
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    assert "zzz" not in seen.getvalue()


def test_a_wrong_model_path_gives_one_clear_line(tmp_path):
    child = pexpect.spawn(sys.executable, [str(ROOT / "infer.py"), "--target", str(tmp_path / "missing")],
                          cwd=str(ROOT), encoding="utf-8", timeout=60)
    child.expect_exact("could not load the model")
    child.expect(pexpect.EOF)
    assert "Traceback" not in child.before
