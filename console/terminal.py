"""The console's terminal: whole characters in the stream, keys typed during a generation, Ctrl-C's reach."""

from __future__ import annotations

import atexit
import os
import select
import signal
import sys
from contextlib import contextmanager

try:
    import termios
except ImportError:  # Windows: no terminal modes to set
    termios = None

REPLACEMENT = "\ufffd"  # what a decoder shows for the bytes of a character not complete yet


class TextStream:
    """The text of the tokens generated so far, shown a piece at a time, whole characters only: a
    token that ends inside a UTF-8 character (emoji, CJK under byte-level BPE) decodes to U+FFFD, so
    that tail waits for the tokens that complete it (`finish` shows whatever is left)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.shown = ""

    def push(self, tokens) -> str:
        """Add `tokens` -> the new text to show (may be empty while a character is incomplete)."""
        self.ids.extend(tokens)
        return self._advance(self._text().rstrip(REPLACEMENT))

    def skip(self, tokens) -> None:
        """Tokens shown another way (the debug mode's colours): counted, never shown again."""
        self.ids.extend(tokens)
        self.shown = self._text()

    def finish(self) -> str:
        """The rest of the text, held-back bytes included (a character the generation never completed)."""
        return self._advance(self._text())

    def _text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def _advance(self, text: str) -> str:
        new = text[len(self.shown) :]
        if new:
            self.shown = text
        return new


class Status:
    """A spinner with a message, from entering the block until `stop` (or the block's end)."""

    def __init__(self, console, message: str) -> None:
        self._status = console.status(message, spinner="dots")
        self.running = False

    def __enter__(self) -> Status:
        self._status.start()
        self.running = True
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> bool:
        """Stop the spinner; True the first time (the caller's moment to print what follows it)."""
        if not self.running:
            return False
        self.running = False
        self._status.stop()
        return True


@contextmanager
def keys_ignored(stream=None):
    """Inside the block, keys typed into the terminal are neither echoed nor kept for the next prompt
    (Ctrl-C still interrupts: signals stay on). Without a terminal: nothing to do."""
    stream = sys.stdin if stream is None else stream
    saved = None
    if termios is not None:
        try:
            fd = stream.fileno()
            saved = termios.tcgetattr(fd) if os.isatty(fd) else None
        except (AttributeError, OSError, ValueError, termios.error):
            saved = None
    if saved is None:
        yield
        return
    quiet = list(saved)
    quiet[3] &= ~(termios.ECHO | termios.ICANON)  # lflag: no echo, no line editing
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcflush(fd, termios.TCIFLUSH)  # what was typed meanwhile is dropped
        termios.tcsetattr(fd, termios.TCSANOW, saved)


def wait_for_a_line(stream=None, poll_s: float = 0.2) -> None:
    """Return once the terminal holds a line (or an end of input) for `input()` to read.
    CPython runs a Ctrl-C's handler only where a blocking read is interrupted: a Ctrl-C that lands
    between the prompt and the read (a loaded machine descheduling us there) would wait inside the
    read for the next key. Waiting here, in slices of `poll_s`, runs it within a slice. Without a
    terminal (a pipe, Windows): returns at once."""
    stream = sys.stdin if stream is None else stream
    try:
        if os.name != "posix" or not os.isatty(stream.fileno()):
            return
    except (AttributeError, OSError, ValueError):
        return
    while not select.select([stream], [], [], poll_s)[0]:
        pass


def own_ctrl_c(fd: int = 0) -> None:
    """Take Ctrl-C from a parent that shares our process group (`make chat`): GNU make, sent SIGINT
    with us, waits for us and then kills itself with it, so a console that exits 0 still ends the
    make with signal 2. In a process group of our own, made the terminal's foreground, only the
    console hears the terminal's keys; the terminal goes back to the parent's group at exit.
    Does nothing where we lead our group already (a shell's job, a pseudo-terminal's session)."""
    if termios is None or not hasattr(os, "tcsetpgrp") or os.getpgrp() == os.getpid():
        return
    try:
        if not os.isatty(fd) or os.tcgetpgrp(fd) != os.getpgrp():
            return  # not in the terminal's foreground: nothing to take
        parent_group = os.getpgrp()
        os.setpgid(0, 0)
        _set_foreground(fd, os.getpgrp())
    except OSError:
        return
    atexit.register(_set_foreground, fd, parent_group)
    # Ctrl-Z would stop this group alone, and the shell, waiting on make, would not get the terminal back.
    signal.signal(signal.SIGTSTP, signal.SIG_IGN)


def _set_foreground(fd: int, group: int) -> None:
    """tcsetpgrp from outside the foreground group: SIGTTOU ignored meanwhile, as shells do."""
    previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        os.tcsetpgrp(fd, group)
    except OSError:
        pass
    finally:
        signal.signal(signal.SIGTTOU, previous)
