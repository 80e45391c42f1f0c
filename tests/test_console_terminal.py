"""The console's terminal in-process: whole characters in the stream, keys typed during a generation,
bounded counts, transformers' keys in the console's words, max_gen_len within the context."""

import io
import os
import signal
import termios
import threading
import time

import pytest
from rich.console import Console
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers import models as tokenizer_models
from transformers import PreTrainedTokenizerFast

from console.app import ChatConsole
from console.models import load
from console.settings import parse_processor
from console.terminal import REPLACEMENT, TextStream, keys_ignored, wait_for_a_line
from sampling import Step
from tests.saved_model import save_tiny_chat_model

TEXT = "héllo 🙂 世界, naïve café"


@pytest.fixture(scope="module")
def byte_tokenizer():
    """One token per byte (byte-level BPE without merges): every multi-byte character spans tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(tokenizer_models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


@pytest.mark.parametrize("step", [1, 2, 3])
def test_the_stream_shows_whole_characters_only(byte_tokenizer, step):
    ids = byte_tokenizer(TEXT)["input_ids"]
    assert len(ids) > len(TEXT)  # characters of several bytes, hence tokens
    stream, pieces = TextStream(byte_tokenizer), []
    for start in range(0, len(ids), step):
        pieces.append(stream.push(ids[start : start + step]))
    pieces.append(stream.finish())
    assert "".join(pieces) == TEXT
    assert not any(REPLACEMENT in piece for piece in pieces)
    assert "" in pieces  # some token ended inside a character: nothing shown for it


def test_a_character_never_completed_is_shown_at_the_end(byte_tokenizer):
    ids = byte_tokenizer("ok 🙂")["input_ids"]
    stream = TextStream(byte_tokenizer)
    assert stream.push(ids[:-1]) == "ok "  # the emoji's last byte never comes
    assert stream.finish() == REPLACEMENT


def test_tokens_shown_another_way_are_not_shown_again(byte_tokenizer):
    stream = TextStream(byte_tokenizer)
    stream.skip(byte_tokenizer("debug ")["input_ids"])
    assert stream.push(byte_tokenizer("text")["input_ids"]) == "text" and stream.finish() == ""


def test_keys_typed_during_a_generation_are_not_echoed_nor_kept():
    leader, follower = os.openpty()
    try:
        with os.fdopen(os.dup(follower)) as terminal:
            before = termios.tcgetattr(follower)
            with keys_ignored(terminal):
                inside = termios.tcgetattr(follower)
                assert not inside[3] & termios.ECHO and not inside[3] & termios.ICANON
                assert inside[3] & termios.ISIG  # Ctrl-C still stops the generation
                os.write(leader, b"typed meanwhile\n")
            assert termios.tcgetattr(follower) == before
            os.write(leader, b"next prompt\n")
            os.set_blocking(follower, False)
            assert os.read(follower, 100) == b"next prompt\n"  # what was typed meanwhile is gone
    finally:
        os.close(leader)
        os.close(follower)


def test_the_wait_for_a_line_ends_when_one_is_typed():
    leader, follower = os.openpty()
    try:
        with os.fdopen(os.dup(follower)) as terminal:
            threading.Timer(0.3, os.write, (leader, b"w5 w6\n")).start()
            wait_for_a_line(terminal, poll_s=0.05)
            assert terminal.readline() == "w5 w6\n"
    finally:
        os.close(leader)
        os.close(follower)


def test_a_ctrl_c_that_interrupts_no_read_still_ends_the_wait():
    """The handler trips where no read of ours is interrupted (here: in another thread; in the console:
    before input() reaches its read): a blocking read would wait for the next key, the wait does not."""
    leader, follower = os.openpty()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    bystander = threading.Thread(target=time.sleep, args=(2,))
    bystander.start()
    try:
        with os.fdopen(os.dup(follower)) as terminal:
            threading.Timer(0.3, signal.pthread_kill, (bystander.ident, signal.SIGINT)).start()
            start = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                wait_for_a_line(terminal, poll_s=0.05)
            assert time.monotonic() - start < 1.5  # within slices of the wait, not at the next key
    finally:
        signal.signal(signal.SIGINT, previous)
        bystander.join()
        os.close(leader)
        os.close(follower)


def test_the_wait_for_a_line_without_a_terminal_returns_at_once():
    wait_for_a_line(io.StringIO())


def test_keys_ignored_without_a_terminal_does_nothing():
    with keys_ignored(io.StringIO()):
        pass


@pytest.mark.parametrize("args, expected", [
    (["repetition_penalty=-1"], "repetition_penalty must be > 0 (1: off), got -1"),
    (["repetition_penalty=0"], "repetition_penalty must be > 0"),
    (["top_p=1.5"], "top_p must be in (0, 1]"),
    (["min_p=-0.1"], "min_p must be in [0, 1]"),
    (["temperature=0"], "temperature must be > 0"),
    (["top_k=-3"], "top_k must be >= 0"),
    (["no_repeat_ngram_size=-1"], "no_repeat_ngram_size must be >= 0"),
    (["typical_p=0"], "typical_p must be in (0, 1]"),
    (["epsilon_cutoff=1"], "epsilon_cutoff must be in [0, 1)"),
    (["eta_cutoff=nan"], "eta_cutoff must be in [0, 1)"),
])
def test_transformers_keys_are_refused_in_the_consoles_words(args, expected):
    with pytest.raises(ValueError) as error:
        parse_processor(args)
    assert str(error.value).startswith(expected) and "`penalty`" not in str(error.value)


def test_every_transformers_key_in_range_builds():
    name, settings = parse_processor(["repetition_penalty=1.2", "no_repeat_ngram_size=0", "min_length=2", "temperature=0.7",
                                      "top_k=0", "top_p=1", "min_p=0", "typical_p=1", "epsilon_cutoff=0", "eta_cutoff=0"])
    assert name == "generate" and settings["do_sample"]


@pytest.fixture(scope="module")
def short_context_dir(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-64"), max_positions=64)


@pytest.fixture
def app(short_context_dir, monkeypatch):
    monkeypatch.setenv("SPECDEC_CALIBRATE", "0")
    console = Console(file=io.StringIO(), width=200)
    return ChatConsole(load(str(short_context_dir), {}, console), None, console)


def output(app) -> str:
    text = app.console.file.getvalue()
    app.console.file.seek(0)
    app.console.file.truncate()
    return text


@pytest.mark.parametrize("line, expected", [
    ("/gamma 1000", "usage: /gamma <n>, n an integer from 1 to 31"),
    ("/length 65", "usage: /length <n>, n an integer from 1 to 64 (the model's context)"),
    ("/branching 100", "usage: /branching <n|auto>, n an integer from 1 (chains) to 8"),
    ("/set_ngram multi 1000", "usage: /set_ngram <simple|multi> <n>, n an integer from 2 to 32"),
    ("/seed 18446744073709551616", "n an integer from 0 to 2**64 - 1"),
])
def test_numeric_commands_are_bounded_and_say_the_range(app, line, expected):
    assert app.command(line)
    assert expected in output(app)


def test_a_max_gen_len_past_the_context_is_capped_in_one_line(app):
    assert app.command("/length 64")
    output(app)
    app.answer("w5 w6 w7")
    lines = [line for line in output(app).splitlines() if "capped" in line]
    assert len(lines) == 1 and "max_gen_len 64 capped at" in lines[0] and "64 positions" in lines[0]


def test_a_prompt_that_fills_the_context_is_refused_before_any_model_runs(app, monkeypatch):
    monkeypatch.setattr("console.app.run_method", lambda *a, **k: pytest.fail("a model ran"))
    with pytest.raises(ValueError, match="fills the model's context of 64 tokens: /clear"):
        app.answer(" ".join(["w5"] * 80))


def test_the_prompt_pass_shows_a_spinner_until_the_first_step(app, monkeypatch):
    events = []

    class Recorded:
        def __init__(self, console, message):
            self.message, self.running = message, False

        def __enter__(self):
            events.append(("spinner", self.message))
            self.running = True
            return self

        def __exit__(self, *exc):
            self.stop()

        def stop(self):
            was, self.running = self.running, False
            if was:
                events.append(("stopped", self.message))
            return was

    def run_method(method, inputs, settings, *, on_step, **models):
        events.append(("prompt pass", method))
        for token in inputs[:2]:
            on_step(Step(drafts=(), accepted=0, tokens=(token,)))
        return list(inputs[:2]), None

    monkeypatch.setattr("console.app.Status", Recorded)
    monkeypatch.setattr("console.app.run_method", run_method)
    monkeypatch.setattr(app, "report", lambda results: None)
    app.settings.methods.update(target=True, ngram=False)
    app.answer("w5 w6 w7")
    (spinner, message), pass_, stopped = events
    assert spinner == "spinner" and message.startswith("[target] reading the prompt (") and "tokens)" in message
    assert pass_ == ("prompt pass", "target") and stopped == ("stopped", message)  # at the first step, once
    assert "[target] " in output(app)
