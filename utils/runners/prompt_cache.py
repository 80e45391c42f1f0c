"""A conversation's keys and values kept for its next turn (`PromptCache`, the `prompt_cache=` of every decoding
function): a call whose prompt starts with the tokens the last call of the same model ended on (the conversation so
far, a long document asked about again) reads only the rest of its prompt.

A chat re-sends its whole history every turn, so without it the prompt pass grows with the conversation: on a CPU it
is seconds per thousand tokens (docs/results.md), paid again at every turn for tokens whose keys and values the last
call had. transformers reuses a prompt's cache when it is handed back (`past_key_values`), llama.cpp and vLLM keep a
prefix by themselves; here the cache is the caller's object, so that a call without one computes what it always did.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from utils.lean import lean_decoder
from utils.lean.static_kv import StaticKV
from utils.runners.protocol import common_prefix
from utils.runners.static import StaticRunner


@dataclass
class _Kept:
    forward: weakref.ref  # to the model's lean forward the keys were computed by (rebuilt when its weights change;
    # a reference to it would keep the model, the dictionary's weak key, alive)
    tokens: list[int]  # the tokens of slots 0 .. len - 1 of `kv`'s row 0
    kv: StaticKV


class PromptCache:
    """The keys and values of the last sequence each model decoded with this cache, kept for the next call whose
    prompt starts with the same tokens: that call's prompt pass reads only the tokens after the common prefix.

    Kept for one row (a batch computes its prompts whole and keeps nothing), where our own forward runs the model
    with a cache (`utils.lean`; another model computes its whole prompt each call); what a call keeps is its prompt
    and generated tokens but the last (the one no pass has read), and the next call with the same model takes it
    (a model whose forward was rebuilt since, its weights changed, starts afresh). A drafter over the target's
    cache (the self-drafter) reads the kept keys as the target's; a drafter model keeps its own under its model.

    The kept keys are those computed when their tokens were read or generated, by passes of other widths than one
    prompt pass over the whole conversation: the same values but for the rounding, so in bfloat16 a reply may part
    from the same call without the cache where two tokens are within its rounding (a near-tie), as a prompt read in
    two pieces may. Calls that start from the same kept keys (speculative or plain decoding) give the same tokens.

    `reused_tokens` and `read_tokens` count, over the cache's calls, the prompt tokens taken from it and those read
    by a prompt pass."""

    def __init__(self) -> None:
        self._kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _Kept
        self.reused_tokens = 0
        self.read_tokens = 0

    def kept_tokens(self, model) -> list[int]:
        """The tokens kept for `model` (what its next call can skip), [] when none are."""
        kept = self._kept.get(model)
        return list(kept.tokens) if kept is not None else []

    def reusable(self, model, prompt: list[int]) -> int:
        """How many leading tokens of `prompt` (the tokens a call's prompt pass reads: its prompt but the last
        token) the kept keys of `model` hold: what a call would not read again."""
        kept = self._kept.get(model)
        if kept is None or kept.forward() is not lean_decoder(model):
            return 0
        return common_prefix(kept.tokens, prompt)

    def clear(self) -> None:
        """Forget every model's kept keys (a new conversation)."""
        self._kept.clear()

    def restore(self, runner, prompt: list[int]) -> int:
        """Put into `runner` (fresh: no row holds a token yet) the kept keys of the longest common prefix of `prompt`
        (the tokens its prompt pass reads) and of what its model's last call kept -> how many tokens it holds now.
        0 where nothing is kept for the model, the runner is not our own forward's over one row, or the model's
        forward was rebuilt since. The entry is taken: the runner's buffer is the next one kept (`keep`)."""
        ours = isinstance(runner, StaticRunner) and len(runner.rows) == 1 and not runner.row_length(0)
        common = min(self.reusable(runner.model, prompt), runner.slots) if ours else 0
        kept = self._kept.pop(runner.model, None)
        if common:
            runner.hold(kept.kv, prompt[:common], prompt_follows=common < len(prompt))
        self.reused_tokens += common
        self.read_tokens += len(prompt) - common
        return common

    def keep(self, runner, sequence: list[int]) -> None:
        """After a one-row call: keep `runner`'s keys for its model's next call, those of `sequence` (the call's
        prompt and generated tokens) but its last token, as far as the runner holds them."""
        if not isinstance(runner, StaticRunner) or len(runner.rows) != 1:
            return
        held = [int(token) for token in runner.rows[0][: len(sequence) - 1]]  # a drafted token may be a 0-d tensor
        length = common_prefix(held, sequence)
        if length:
            self._kept[runner.model] = _Kept(weakref.ref(lean_decoder(runner.model)), sequence[:length], runner.kv)
