"""Beam search with the GNMT length penalty (Wu et al. 2016)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from sampling.loop.common import Generation, measured_costs, start_generation
from sampling.loop.habits import Habits
from sampling.loop.options import DecodingOptions, check_request
from sampling.loop.stopping import Criterion
from utils.runners.factory import make_beam_runner
from utils.runners.model_info import is_encoder_decoder
from utils.validation import Inputs, check_int, transformers_names

SHARED = DecodingOptions  # the defaults every decoding function shares (max_gen_len, use_cache, end tokens...)


def gnmt_penalty(length: int, min_length: int, length_penalty: float) -> float:
    """lp(Y) = ((min_length + |Y|) / (min_length + 1)) ** length_penalty; GNMT uses min_length = 5."""
    return ((min_length + length) / (min_length + 1)) ** length_penalty


def seed_name_alpha(function: Callable) -> Callable:
    """`alpha=`, the seed README's name of the length penalty, is still taken (as `length_penalty`);
    giving both names is refused, since `alpha` elsewhere is the acceptance rate."""

    @functools.wraps(function)
    def renamed(*args, **kwargs):
        if kwargs.get("alpha") is not None and "length_penalty" in kwargs:
            raise ValueError(f"beam_search_generate got length_penalty={kwargs['length_penalty']!r} and "
                             f"alpha={kwargs['alpha']!r}: alpha is the former name of length_penalty; pass length_penalty only")
        return function(*args, **kwargs)

    return renamed


def check_beam_arguments(top_k: int, num_beams: int, min_length: int, length_penalty: float, alpha: float | None,
                         num_return_sequences: int) -> float:
    """Beam search's own arguments, checked before any model runs -> the length penalty (`alpha`, the
    seed's name of it, when given)."""
    check_int(top_k, "top_k", 1)
    check_int(num_beams, "num_beams", 1)
    check_int(min_length, "min_length", 0)
    name, length_penalty = ("length_penalty", length_penalty) if alpha is None else ("alpha", alpha)
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)):
        raise TypeError(f"{name} must be a number >= 0 (the length penalty's exponent), got {length_penalty!r}")
    if not length_penalty >= 0:
        raise ValueError(f"{name} must be >= 0 (the length penalty's exponent; 0: no penalty), got {length_penalty}")
    n = check_int(num_return_sequences, "num_return_sequences", 1)
    if n > num_beams:
        raise ValueError(f"num_return_sequences must be <= num_beams ({num_beams}): the best finished beams are "
                         f"returned, got {n}")
    return length_penalty


@transformers_names
@seed_name_alpha
def beam_search_generate(
    inputs: Inputs,
    model: PreTrainedModel,
    *,
    max_gen_len: int = SHARED.max_gen_len,
    end_tokens_id: int | list[int] | None = SHARED.end_tokens_id,
    pad_token_id: int | None = SHARED.pad_token_id,
    top_k: int = 3,
    num_beams: int = 5,
    min_length: int = 5,
    length_penalty: float = 1.2,
    alpha: float | None = None,
    use_cache: bool = SHARED.use_cache,
    tokenizer=Habits.tokenizer,
    stop_strings: str | list[str] | None = Habits.stop_strings,
    stopping_criteria: Criterion | list[Criterion] | None = Habits.stopping_criteria,
    num_return_sequences: int = Habits.num_return_sequences,
) -> list[int] | list[list[int]]:
    """Beam search over a decoder-only model -> the best finished sequence's generated ids.

    Each step expands every live beam with its `top_k` most likely tokens and keeps the
    `num_beams` candidates with the highest sum of log-probabilities (all live beams have the same
    length, so the length penalty does not change their order). A beam that emits an end token, or
    reaches `max_gen_len`, is finished with the score  sum(log p) / lp(Y),  where
    lp(Y) = ((min_length + |Y|) / (min_length + 1)) ** length_penalty  is the GNMT length penalty (Wu et al.
    2016) with `min_length` in the role of their constant 5. Finished beams are kept until no live
    beam can beat the best of them. `pad_token_id`: for a batch without an attention mask, the token
    stripped from both ends of each row (it is never an end token). `inputs`: token ids, a tensor, or a tokenizer's output
    (`utils.validation.INPUTS_DOC`); a batch is searched row by row and gives a list, one result
    per row. `alpha`: the seed's name of `length_penalty`, still taken (both at once: a ValueError).
    `stop_strings` (with `tokenizer`) and `stopping_criteria` finish a beam as an end token does
    (the criteria get the beam's ids and its log-probabilities as scores). `num_return_sequences=n`
    (<= num_beams): the n best finished beams, best first, a list of n id lists for one prompt
    (for a batch, each row's n side by side, as transformers orders them); fewer only when fewer
    beams could finish.
    """
    if is_encoder_decoder(model):
        raise ValueError(f"beam_search_generate supports decoder-only models; model is {type(model).__name__}, an encoder-decoder")
    length_penalty = check_beam_arguments(top_k, num_beams, min_length, length_penalty, alpha, num_return_sequences)
    n = num_return_sequences
    # num_return_sequences is the n best beams here, not n copies of each row: not one of its habits.
    options = DecodingOptions(max_gen_len=max_gen_len, end_tokens_id=end_tokens_id, pad_token_id=pad_token_id,
                              use_cache=use_cache, habits=Habits(tokenizer, stop_strings, stopping_criteria))
    request = check_request(inputs, model, options, encoder_decoder=False)
    # The beams of one row already fill the batch dimension: a batch's rows are searched one by one.
    costs = measured_costs(model)  # the first call with a model calibrates it
    results = [_search(start_generation(request.row(i), costs), model, top_k, num_beams, min_length, length_penalty=length_penalty,
                       use_cache=use_cache, n=n)
               for i in range(request.num_rows)]
    if n > 1:
        return [ids for best in results for ids in best]
    results = [best[0] for best in results]
    return results if request.batched else results[0]


def _search(gen: Generation, model: PreTrainedModel, top_k: int, num_beams: int, min_length: int, *,
            length_penalty: float, use_cache: bool, n: int = 1) -> list[list[int]]:
    """Beam search of one sequence (`gen` holds one row) -> the `n` best finished sequences' generated
    ids. `length_penalty`: the exponent of `gnmt_penalty`."""
    max_len = gen.max_new_tokens[0]
    runner = make_beam_runner(model, use_cache=use_cache, costs=gen.runner.costs,  # its kernels measured here
                              max_tokens=len(gen.prefix) + max_len)

    def best_possible(score: float, length: int) -> float:
        # Log-probabilities only decrease a sum (<= 0); the penalty may still favour either end.
        return max(score / gnmt_penalty(length, min_length, length_penalty),
                   score / gnmt_penalty(max_len, min_length, length_penalty))

    finished: list[tuple[float, list[int]]] = []  # (penalised score, generated ids)
    scores = torch.zeros(1, dtype=torch.float64)  # sum of log-probabilities of each live beam
    logits = runner.start(gen.prefix)
    for length in range(1, max_len + 1):
        # 1. Expand: the top_k tokens of each live beam, scored by the beam's new sum.
        log_probs = logits.cpu().double().log_softmax(dim=-1)  # on the host: a device may lack float64 (MPS)
        k = min(top_k, log_probs.shape[-1])
        top_log_probs, top_tokens = log_probs.topk(k, dim=-1)
        candidates = (scores[:, None] + top_log_probs).flatten()
        order = candidates.argsort(descending=True)
        # 2. Split the best candidates into finished and (at most num_beams) live beams.
        # Candidates share one length, so raw and penalised scores have the same order: once the
        # live beams are full and a candidate cannot enter the kept finished ones, none after can.
        worst_kept = finished[-1][0] if len(finished) >= num_beams else -math.inf
        penalty = gnmt_penalty(length, min_length, length_penalty)
        live_idx, live_tokens, live_scores = [], [], []
        history = runner.sequences[:, len(gen.prefix) :].cpu()
        for c in order.tolist():
            beam = c // k
            token = int(top_tokens[beam, c % k])
            score = float(candidates[c])
            if len(live_idx) == num_beams and score / penalty < worst_kept:
                break
            if token in gen.end_tokens or length == max_len or _stops(gen, history[beam], token, log_probs[beam]):
                finished.append((score / penalty, history[beam].tolist() + [token]))
            elif len(live_idx) < num_beams:
                live_idx.append(beam)
                live_tokens.append(token)
                live_scores.append(score)
        finished = sorted(finished, key=lambda f: f[0], reverse=True)[:num_beams]
        # 3. Stop when no live beam can beat the n-th best finished one.
        if not live_idx or (len(finished) >= n and finished[n - 1][0] >= max(best_possible(s, length) for s in live_scores)):
            break
        scores = torch.tensor(live_scores, dtype=torch.float64)
        device = runner.sequences.device
        logits = runner.step(torch.tensor(live_idx, device=device), torch.tensor(live_tokens, device=device))
    return [ids for _, ids in finished[:n]]


def _stops(gen: Generation, history: torch.Tensor, token: int, log_probs: torch.Tensor) -> bool:
    """Whether a stopping rule finishes the beam `history` (its generated ids) extended by `token`."""
    if gen.stopping is None:
        return False
    return gen.stopping.stops([*gen.prefix, *history.tolist(), token], log_probs)
