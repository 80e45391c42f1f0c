"""Interactive console: chat with a model and compare decoding methods side by side.

    python infer.py                      # the built-in SmolLM2-135M-Instruct, offline, n-gram drafter
    python infer.py --target qwen2.5-coder-1.5b-instruct --drafter qwen2.5-coder-0.5b-instruct
    python infer.py --target NAME --drafter NAME   # short names, Hub names or local folders

Type /help for the commands. The console itself lives in the `console` package.
"""

from __future__ import annotations

import sys
import threading


def _show_start(started: threading.Event) -> None:
    print("Starting the console (loading PyTorch and transformers)", end="", flush=True)
    while not started.wait(0.5):
        print(".", end="", flush=True)
    print(flush=True)


def main(argv: list[str] | None = None) -> int:
    """Import the console (seconds: PyTorch and transformers) behind a line of dots, then run it."""
    from utils.threads import settle_openmp  # no torch: OpenMP reads its settings once, when torch starts

    note = settle_openmp()  # beside other busy processes: fewer threads, idle ones asleep (one line says so)
    if note:
        print(note, flush=True)
    started = threading.Event()
    dots = threading.Thread(target=_show_start, args=(started,), daemon=True)
    dots.start()
    try:
        from console.cli import main as console_main
    finally:
        started.set()
        dots.join()
    return console_main(argv)


if __name__ == "__main__":
    sys.exit(main())
