"""The chat loop: read a line, run a /command or answer the prompt with every method that is on."""

from __future__ import annotations

import time
from dataclasses import replace

from rich.console import Console
from rich.text import Text

from console.commands import QUIT, dispatch
from console.models import Model, check_pair, check_self, drafter_hint, own_drafter, run_method, same_tokenizer
from console.render import Result, legend, render_step, results_table, same_tokens_line
from console.settings import SPECULATIVE, Settings
from console.terminal import Status, TextStream, keys_ignored, wait_for_a_line
from ngram_assisted import MultiDynaGram, SimpleDynaGram
from sampling import Step
from utils.calibration import pass_costs
from utils.runners.model_info import context_length
from utils.runners.prompt_cache import PromptCache


class ChatConsole:
    """The console's state (models, settings, conversation, n-gram pool); `run` is the loop."""

    def __init__(self, target: Model, drafter: Model | None, console: Console, system_prompt: str | None = None,
                 options: dict | None = None) -> None:
        self.target, self.drafter = target, drafter
        self.console = console
        self.options = options or {}  # how `/load` loads a model (dtype, device, ...)
        self.settings = Settings()
        self.settings.methods["speculative"] = drafter is not None
        self.system_prompt = system_prompt
        self.history: list[dict] = []
        self.pool = self.new_pool()
        # Each method's last call's keys, kept for its next turn (`PromptCache`): a method reads only what the
        # conversation added since its own last answer, and times only its own passes.
        self.prompt_caches: dict[str, PromptCache] = {}

    def new_pool(self):
        s = self.settings
        return (MultiDynaGram if s.ngram_kind == "multi" else SimpleDynaGram)(s.ngram_n)

    def set_target(self, target: Model) -> str | None:
        """A new target: a drafter that cannot draft for it is dropped, `/self` goes off where the target
        cannot draft for itself, the n-gram pool starts afresh (other token ids); the conversation is text
        and stays. Returns a note or None."""
        self.target = target
        self.pool = self.new_pool()
        notes = []
        if self.settings.methods["self"]:
            try:
                check_self(target)
            except ValueError as error:
                self.settings.methods["self"] = False
                notes.append(f"self: off ({error})")
        if self.drafter is None:
            notes.append(drafter_hint(target))
        else:
            try:
                check_pair(target, self.drafter)
            except ValueError:
                dropped, self.drafter = self.drafter.label, None
                self.settings.methods["speculative"] = self.settings.methods["drafter"] = False
                notes.append(f"drafter {dropped} dropped (another tokenizer); {drafter_hint(target)}")
        return "; ".join(notes) or None

    def say(self, message) -> None:
        """Print as is; a text line is wrapped by the terminal, not broken by rich (it stays one line)."""
        self.console.print(message, markup=False, highlight=False, soft_wrap=isinstance(message, (str, Text)))

    def error(self, message: str) -> None:
        """One red line, whatever the message holds."""
        self.console.print(Text(" ".join(str(message).split()), style="red"), soft_wrap=True)

    def command(self, line: str) -> bool:
        """Run one /command; False means quit. Bad input prints one line; nothing escapes."""
        try:
            answer = dispatch(self, line)
        except (ValueError, TypeError) as error:
            self.error(str(error))
            return True
        except Exception as error:  # nothing crashes the console
            self.error(f"{line.split()[0]} failed: {type(error).__name__}: {error}")
            return True
        if answer is QUIT:
            return False
        if answer is not None:
            self.say(answer)
        return True

    # Generation ------------------------------------------------------------------------------

    def tokenizer_of(self, method: str):
        """The tokenizer a method's ids are in: the drafter's own for `/drafter` (it may differ from the target's)."""
        if method == "drafter" and self.drafter is not None and self.other_vocabulary():
            return self.drafter.tokenizer
        return self.target.tokenizer

    def other_vocabulary(self) -> bool:
        """Whether the drafter drafts in another vocabulary than the target's (universal speculative decoding)."""
        return self.drafter is not None and not same_tokenizer(self.target.tokenizer, self.drafter.tokenizer)

    def encode(self, user_text: str, tokenizer) -> list[int]:
        if self.settings.chat and getattr(tokenizer, "chat_template", None):
            messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
            messages += self.history + [{"role": "user", "content": user_text}]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return tokenizer(user_text)["input_ids"]

    def streamer(self, method: str, stream: TextStream, prompt_pass: Status):
        """An on_step callback that ends the prompt pass's spinner at the first step, then prints the
        new text, whole characters only (coloured by origin in debug mode)."""

        def on_step(step: Step) -> None:
            if prompt_pass.stop():
                self.console.print(Text(f"[{method}] ", style="bold cyan"), end="")
            if self.settings.debug and method in SPECULATIVE:
                stream.skip(step.tokens)
                self.console.print(render_step(step, stream.tokenizer), end="")
                return
            self.console.print(stream.push(step.tokens), end="", markup=False, highlight=False)

        return on_step

    def within_context(self, method: str, inputs: list[int]) -> tuple[Settings, str | None]:
        """The settings for `method` on `inputs`: `max_gen_len` capped at what the models' context leaves
        after the prompt, and the line that says so (or None); a prompt that fills it raises a one-line ValueError."""
        models = [self.drafter if method == "drafter" else self.target]
        if method == "speculative" and self.drafter is not None:
            models.append(self.drafter)
        limits = [limit for limit in (context_length(m.model) for m in models) if limit is not None]
        if not limits:
            return self.settings, None
        limit = min(limits)
        room = limit - len(inputs)
        if room < 1:
            raise ValueError(f"the prompt ({len(inputs)} tokens) fills the model's context of {limit} tokens: "
                             "/clear forgets the conversation")
        if self.settings.max_gen_len <= room:
            return self.settings, None
        note = f"max_gen_len {self.settings.max_gen_len} capped at {room}: the prompt takes {len(inputs)} of the model's {limit} positions"
        return replace(self.settings, max_gen_len=room), note

    def answer(self, user_text: str) -> None:
        """Answer with every method that is on, one after the other, then compare them."""
        methods = [m for m, on in self.settings.methods.items() if on]
        if not methods:
            self.error("every method is off: turn one on, e.g. /target")
            return
        if self.settings.debug and set(SPECULATIVE) & set(methods):
            self.say(legend())
        results, notes = [], set()
        for method in methods:
            if method == "ngram" and self.settings.reset_in_between:
                self.pool.reset()
            if method == "self":  # a new target's four-bit copy: built (and said so) before the spinner
                own_drafter(self.console, self.target)
            tokenizer = self.tokenizer_of(method)
            inputs = self.encode(user_text, tokenizer)
            settings, note = self.within_context(method, inputs)
            if note is not None and note not in notes:  # one line, not one per method
                notes.add(note)
                self.say(Text(note, style="yellow"))
            stream = TextStream(tokenizer)
            cache = self.prompt_caches.setdefault(method, PromptCache())
            # The prompt pass (seconds for a long conversation) under a spinner, until the first step.
            prompt_pass = Status(self.console, f"[{method}] " + ("searching 4 beams" if method == "beam" else
                                                                 self.reading(method, inputs, cache)))
            start = time.perf_counter()
            with keys_ignored(), prompt_pass:
                ids, stats = run_method(method, inputs, settings, target=self.target, drafter=self.drafter, pool=self.pool,
                                        on_step=None if method == "beam" else self.streamer(method, stream, prompt_pass),
                                        prompt_cache=cache)
            seconds = time.perf_counter() - start
            text = tokenizer.decode(ids, skip_special_tokens=True)
            if method == "beam" or not stream.ids:  # no step streamed: the label was not shown yet
                self.console.print(Text(f"[{method}] ", style="bold cyan"), end="")
            if method == "beam":
                self.say(text)
            else:
                self.console.print(stream.finish(), markup=False, highlight=False)
            results.append(Result(method, ids, seconds, stats, text, prior_costs=self.prior_costs(method)))
        self.report(results)
        if self.settings.chat:
            reply = results[0].text
            self.history += [{"role": "user", "content": user_text}, {"role": "assistant", "content": reply}]

    def reading(self, method: str, inputs: list[int], cache: PromptCache) -> str:
        """The spinner's words while `method` reads its prompt: how many tokens, and how many its last answer kept."""
        model = (self.drafter if method == "drafter" else self.target).model
        kept = cache.reusable(model, inputs[:-1])
        return f"reading the prompt ({len(inputs)} tokens" + (f", {kept} kept from the last answer)" if kept else ")")

    def prior_costs(self, method: str) -> bool:
        """Whether `method` sized its drafts on prior pass costs (`utils.calibration`: not measured
        here), for the target or, with a drafter model (the target's four-bit copy for `/self`), for it."""
        if method not in SPECULATIVE:
            return False
        models = [self.target.model] + ([self.drafter.model] if method == "speculative" and self.drafter else [])
        models += [self.target.four_bit] if method == "self" and self.target.four_bit is not None else []
        return any(not pass_costs(model).measured for model in models)

    def report(self, results: list[Result]) -> None:
        """The methods' speeds against the target's plain decoding, then which methods produced the
        target's very tokens: all of them when greedy, NASD too under a seed (coupled sampling)."""
        table, footnote = results_table(results)
        self.console.print(table)
        if footnote:
            self.say(footnote)
        if self.settings.processor.is_greedy or self.settings.seed is not None:
            line = same_tokens_line(results, skip={"drafter"} if self.other_vocabulary() else set())
            if line:
                self.say(line)

    def run(self) -> None:
        self.say("Type a prompt, or /help for the commands.")
        while True:
            try:
                self.console.print("[bold]> [/bold]", end="")
                wait_for_a_line()  # a Ctrl-C that lands before input() reads still ends the console
                line = self.console.input().strip()
            except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C at the prompt: exit, status 0
                self.console.print()
                break
            if not line:
                continue
            if line.startswith("/"):
                try:
                    if not self.command(line):
                        break
                except KeyboardInterrupt:  # e.g. during a /load
                    self.console.print(Text("\n[stopped]", style="yellow"))
                continue
            try:
                self.answer(line)
            except KeyboardInterrupt:
                self.console.print(Text("\n[generation stopped]", style="yellow"))
            except (ValueError, TypeError) as error:  # bad input, explained by the library
                self.console.print()
                self.error(str(error))
            except Exception as error:  # nothing crashes the console
                self.console.print()
                self.error(f"generation failed: {type(error).__name__}: {error}")
        self.say("bye")
