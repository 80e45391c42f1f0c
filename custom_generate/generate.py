"""NASD inside transformers' `generate`: a decoding method that transformers loads from this folder.

    model.generate(input_ids, custom_generate="path/to/this/repository", trust_remote_code=True,
                   max_new_tokens=100, do_sample=True, temperature=0.7)

runs Ngram Assisted Speculative Decoding (`ngram_assisted_speculative_generate`), or speculative
decoding with a drafter model when `assistant_model=` is given, and returns what `generate`
returns: the prompt and the new tokens, (batch * num_return_sequences, length) LongTensor, finished
rows padded with `pad_token_id` (a `GenerateDecoderOnlyOutput` / `GenerateEncoderDecoderOutput` with
only `sequences` under `return_dict_in_generate=True`). Greedy output is `generate`'s own, token for
token; sampled output follows the same distribution (seeded through torch's global generator
unless `generator=` is given). generate's stopping habits are its own: `stop_strings` (with
`tokenizer=`), `stopping_criteria` (a criterion of a type generate builds itself takes that one's
place, as in generate), `num_return_sequences` (each prompt's copies side by side). Extra keyword
arguments: `gamma`, `ngram` (a dynagram kept across calls), `top_k_filler`, `branching`, `stats`
(a `SpeculativeStats`), `generator`. Every other argument is refused with a ValueError naming it,
never ignored (`HONOURED`, `NEUTRAL`).

transformers (4.57 and 5.x) copies this file into its modules cache and imports it from there, so
the library is found through the installed package (`pip install -e .`) or, failing that, the
repository path given as `custom_generate=`.
"""

from __future__ import annotations

import copy
import inspect
import sys
from pathlib import Path

import torch

NASD_OPTIONS = ("gamma", "ngram", "top_k_filler", "branching", "stats", "generator")
SPECULATIVE_OPTIONS = ("gamma", "stats", "generator")
# GenerationConfig fields that speculative decoding here cannot honour: refused, not ignored.
UNSUPPORTED = {"num_beams": 1, "penalty_alpha": None, "dola_layers": None,
               "forced_bos_token_id": None, "forced_eos_token_id": None, "suppress_tokens": None,
               "begin_suppress_tokens": None, "sequence_bias": None, "min_new_tokens": None, "max_time": None,
               "output_scores": False, "output_logits": False, "output_attentions": False, "output_hidden_states": False,
               "guidance_scale": None, "watermarking_config": None}


# The GenerationConfig fields this method honours, or that ask nothing of it (the token ids generate needs only
# without inputs, the version stamps); any other field given a value of its own is refused (`_not_honoured`).
HONOURED = {"max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p",
            "epsilon_cutoff", "eta_cutoff", "repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "min_length",
            "eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id", "use_cache",
            "stop_strings", "num_return_sequences", "return_dict_in_generate", "transformers_version", "_from_model_config",
            "disable_compile"}  # nothing here is compiled: True and False alike
# Values of the other fields that ask for nothing (transformers 5 leaves them None until generate resolves them).
NEUTRAL = {"num_beams": 1, "num_return_sequences": 1, "num_beam_groups": 1, "output_scores": False, "output_logits": False,
           "output_attentions": False, "output_hidden_states": False, "renormalize_logits": False,
           "remove_invalid_values": False, "low_memory": False, "early_stopping": False, "length_penalty": 1.0,
           "encoder_repetition_penalty": 1.0, "encoder_no_repeat_ngram_size": 0, "diversity_penalty": 0.0,
           "guidance_scale": 1.0, "is_assistant": False, "token_healing": False}
# What to use instead, for the fields a speculative-decoding user is most likely to pass.
INSTEAD = {"prompt_lookup_num_tokens": "this method drafts from an n-gram pool already: gamma= sets its draft length",
           "max_matching_ngram_size": "the pool's n: ngram=MultiDynaGram(n)",
           "num_assistant_tokens": "gamma=", "num_assistant_tokens_schedule": "gamma= (the draft length adapts to costs)",
           "assistant_confidence_threshold": "gamma= (the draft length adapts to costs)"}


def _given(kwargs: dict, generation_config, model) -> dict:
    """The GenerationConfig fields the caller set -> their values: keyword arguments, and a config's
    fields that differ from the model's."""
    given = {}
    if generation_config is not None:
        own = model.generation_config.to_dict()
        given = {name: value for name, value in generation_config.to_dict().items() if own.get(name) != value}
    given.update({name: value for name, value in kwargs.items() if hasattr(model.generation_config, name)})
    return given


def _not_honoured(given: dict) -> tuple[str, object] | None:
    """The first given field outside `HONOURED` that asks for something (not None, empty, neutral or the default)."""
    from transformers import GenerationConfig

    defaults = GenerationConfig().to_dict()
    for name in sorted(set(given) - HONOURED):
        value = given[name]
        empty = isinstance(value, (list, tuple, dict)) and not value
        if value is None or empty or value == defaults.get(name) or (name in NEUTRAL and value == NEUTRAL[name]):
            continue
        return name, value
    return None


def _repository_root() -> Path | None:
    """The repository that holds this folder: the `custom_generate=` path in the calling
    `generate` (this file runs from transformers' copy), or this file's own parent folder."""
    frame = inspect.currentframe()
    while frame is not None:
        path = frame.f_locals.get("custom_generate") if frame.f_code.co_name == "generate" else None
        if isinstance(path, str) and (Path(path) / "custom_generate" / "generate.py").is_file():
            return Path(path).resolve()
        frame = frame.f_back
    here = Path(__file__).resolve().parent.parent
    return here if (here / "sampling").is_dir() else None


def _import_library():
    root = _repository_root()
    if root is not None and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:  # (imports inside `try`: transformers' import check skips them, they are not PyPI packages)
        import ngram_assisted
        import sampling
        from utils import logits_processors
    except ImportError as error:
        raise ImportError(f"custom_generate needs this repository's library (sampling/, ngram_assisted/, utils/): "
                          f"pip install -e <the repository>, or pass its path as custom_generate= ({error})") from error
    return sampling, ngram_assisted, logits_processors


def _processor(config, lp):
    """The library's own processor when the config asks only for temperature / top-k / top-p (one
    pass over all rows), else transformers' processors built from it (each position with its history)."""
    history = (config.repetition_penalty not in (None, 1.0) or config.no_repeat_ngram_size or config.bad_words_ids
               or config.min_length or config.min_p or config.typical_p not in (None, 1.0) or config.epsilon_cutoff
               or config.eta_cutoff)
    if history:
        return lp.TransformersProcessor.from_generation_config(config)
    if not config.do_sample:
        return lp.GreedyProcessor()
    temperature = config.temperature if config.temperature is not None else 1.0
    top_k, top_p = config.top_k or 0, config.top_p if config.top_p is not None else 1.0
    if top_k and top_p < 1.0:
        return lp.TopKNucleusProcessor(temperature=temperature, top_k=top_k, top_p=top_p)
    if top_k:
        return lp.TopKProcessor(temperature=temperature, top_k=top_k)
    if top_p < 1.0:
        return lp.NucleusProcessor(temperature=temperature, top_p=top_p)
    return lp.MultinomialProcessor(temperature=temperature)


def _rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, pad_token_id, eos: list[int]) -> list[list[int]]:
    """Each row's tokens without its padding (the mask's zeros; without a mask, as `generate`
    infers one: `pad_token_id` marks padding when it is not also an end token)."""
    if attention_mask is None and pad_token_id is not None and pad_token_id not in eos:
        attention_mask = input_ids.ne(pad_token_id)
    if attention_mask is None:
        return input_ids.tolist()
    return [row[mask.bool()].tolist() for row, mask in zip(input_ids.cpu(), attention_mask.cpu(), strict=True)]


def _refuse(model, generation_config, kwargs: dict, arguments: dict):
    """generate's arguments -> the GenerationConfig to decode by, with kwargs applied; a ValueError for
    anything this method cannot honour, before any model runs (every argument is honoured or refused)."""
    refused = _not_honoured(_given(kwargs, generation_config, model))  # before the config's own checks: ours name it
    if refused is not None:
        name, value = refused
        instead = f" ({INSTEAD[name]})" if name in INSTEAD else ": use plain generate for it"
        raise ValueError(f"custom_generate (NASD) cannot honour {name}={value!r}{instead}")
    config = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    unused = config.update(**kwargs)  # transformers' own checks: greedy num_return_sequences > 1 is refused there
    for name, value in arguments.items():
        if value is not None and not (name == "logits_processor" and len(value) == 0):
            hint = "; set the processing through the GenerationConfig's fields" if name == "logits_processor" else ""
            raise ValueError(f"custom_generate (NASD) does not take {name}{hint}")
    if unused:
        raise ValueError(f"custom_generate (NASD) does not know these arguments: {sorted(unused)}; it takes "
                         f"generate's GenerationConfig fields, tokenizer and {', '.join(NASD_OPTIONS)}")
    for name, default in UNSUPPORTED.items():
        value = getattr(config, name, default)
        if value not in (default, None, NEUTRAL.get(name)) and not (isinstance(value, (list, tuple)) and not value):
            raise ValueError(f"custom_generate (NASD) cannot honour {name}={value!r}: use plain generate for it")
    return config


def _stopping(config, tokenizer, stopping_criteria) -> tuple[dict, int | None, list[int] | None]:
    """generate's stopping rules -> (the library's stop_strings / tokenizer / stopping_criteria arguments,
    the max_length and the end tokens that the user's criteria set, None where they set none).

    As in generate: stop strings need `tokenizer=`; a criterion of the exact type of one generate builds
    itself (MaxLengthCriteria, EosTokenCriteria, StopStringCriteria) takes that one's place (max_length: the
    least of the user's; end tokens: all of them); the rest are asked after every token, one row at a time."""
    from transformers import EosTokenCriteria, MaxLengthCriteria, StopStringCriteria

    if config.stop_strings is not None and tokenizer is None:
        raise ValueError(f"custom_generate (NASD) got stop_strings={config.stop_strings!r} (in the arguments or the "
                         f"generation config) but no tokenizer: pass the model's tokenizer as tokenizer=, as generate asks")
    if stopping_criteria is None:
        criteria = []
    else:
        criteria = list(stopping_criteria) if isinstance(stopping_criteria, (list, tuple)) else [stopping_criteria]
    lengths = [c.max_length for c in criteria if type(c) is MaxLengthCriteria]
    ends = [int(t) for c in criteria if type(c) is EosTokenCriteria for t in c.eos_token_id.reshape(-1).tolist()]
    criteria = [c for c in criteria if type(c) not in (MaxLengthCriteria, EosTokenCriteria)]
    habits: dict = {"stopping_criteria": criteria or None}
    if config.stop_strings is not None and not any(type(c) is StopStringCriteria for c in criteria):
        habits.update(stop_strings=config.stop_strings, tokenizer=tokenizer)
    return habits, min(lengths) if lengths else None, ends or None


def _max_new_tokens(config, width: int, max_length: int | None) -> int:
    """How many tokens each row may add: `max_new_tokens`, else `max_length` less the decoder's input
    (`width`: the padded prompt, or the decoder start token); a user MaxLengthCriteria's max_length first."""
    if max_length is None and config.max_new_tokens is not None:
        return config.max_new_tokens
    limit = max_length if max_length is not None else config.max_length
    if limit - width < 1:
        raise ValueError(f"max_length={limit} leaves no room after the {width}-token input: set max_new_tokens")
    return limit - width


def _end_tokens(eos) -> list[int]:
    return [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]


def generate(model, inputs=None, generation_config=None, logits_processor=None, stopping_criteria=None,
             prefix_allowed_tokens_fn=None, synced_gpus=None, assistant_model=None, streamer=None,
             negative_prompt_ids=None, negative_prompt_attention_mask=None, **kwargs):
    """`generate` by NASD (or speculative decoding with `assistant_model`) -> (batch * num_return_sequences,
    length) LongTensor."""
    sampling, ngram_assisted, lp = _import_library()
    if kwargs.pop("use_model_defaults", None) is False:  # this method starts from the model's generation_config
        raise ValueError("custom_generate (NASD) cannot honour use_model_defaults=False: pass a generation_config instead")
    input_ids = kwargs.pop("input_ids", None) if inputs is None else inputs
    attention_mask, tokenizer = kwargs.pop("attention_mask", None), kwargs.pop("tokenizer", None)
    options = {name: kwargs.pop(name) for name in NASD_OPTIONS if name in kwargs}
    # 1. Refuse what this method cannot do, before any model runs: every argument is honoured or refused.
    config = _refuse(model, generation_config, kwargs, {
        "prefix_allowed_tokens_fn": prefix_allowed_tokens_fn, "negative_prompt_ids": negative_prompt_ids,
        "logits_processor": logits_processor, "negative_prompt_attention_mask": negative_prompt_attention_mask,
        "synced_gpus": synced_gpus or None})
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        raise TypeError(f"inputs must be a (batch, length) LongTensor of token ids, got {type(input_ids).__name__}")
    if assistant_model is not None and set(options) - set(SPECULATIVE_OPTIONS):
        raise ValueError(f"with assistant_model, only {', '.join(SPECULATIVE_OPTIONS)} apply; "
                         f"got {sorted(set(options) - set(SPECULATIVE_OPTIONS))}")
    habits, max_length, ends = _stopping(config, tokenizer, stopping_criteria)
    n = config.num_return_sequences if config.num_return_sequences is not None else 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:  # generate would take 0 for 1: refused here
        raise ValueError(f"num_return_sequences must be an int >= 1 (the rows returned per input row), got {n!r}")
    eos = ends if ends is not None else _end_tokens(config.eos_token_id)
    pad = config.pad_token_id if config.pad_token_id is not None else (_end_tokens(config.eos_token_id) or [0])[0]
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    rows = _rows(input_ids, attention_mask, config.pad_token_id, _end_tokens(config.eos_token_id))
    max_new = _max_new_tokens(config, 1 if encoder_decoder else input_ids.shape[1], max_length)
    if streamer is not None and len(rows) * n > 1:
        raise ValueError(f"a streamer takes one sequence: pass a batch of one row with streamer= "
                         f"(got {len(rows)} rows, num_return_sequences={n})")

    # 2. Decode the rows (a batch: one list of rows; each one n times, side by side) with the library's loop.
    on_step = None
    if streamer is not None:
        streamer.put(input_ids.cpu())
        on_step = lambda step: streamer.put(torch.tensor(step.tokens, dtype=torch.long))  # noqa: E731
    common = dict(logits_processor=_processor(config, lp), max_gen_len=max_new, end_tokens_id=eos or None,
                  use_cache=config.use_cache if config.use_cache is not None else True, on_step=on_step,
                  num_return_sequences=n, **habits, **options)
    if attention_mask is None and config.pad_token_id is not None:
        common["pad_token_id"] = int(config.pad_token_id)  # a batch without a mask: stripped of it (`_rows` above)
    batch = rows if len(rows) > 1 else rows[0]  # one row: the single call (its generator's own numbers)
    if assistant_model is not None:
        run = sampling.speculative_generate_encoder_decoder if encoder_decoder else sampling.speculative_generate
        results = run(batch, assistant_model, model, **common)
    else:
        common.setdefault("ngram", ngram_assisted.MultiDynaGram(8))
        run = (ngram_assisted.ngram_assisted_speculative_generate_encoder_decoder if encoder_decoder
               else ngram_assisted.ngram_assisted_speculative_generate)
        results = run(batch, common.pop("ngram"), model, **common)
    if streamer is not None:
        streamer.end()
    return _output(model, config, input_ids, [ids for ids, _ in (results if isinstance(results, list) else [results])],
                   n, pad, encoder_decoder)


def _output(model, config, input_ids: torch.Tensor, generated: list[list[int]], n: int, pad: int, encoder_decoder: bool):
    """generate's output: the prompt (decoder-only, as given, each row n times) or the decoder start
    (encoder-decoder), then each returned row's new tokens, padded on the right with `pad`."""
    width = max(len(ids) for ids in generated)
    new = torch.tensor([ids + [pad] * (width - len(ids)) for ids in generated], dtype=torch.long,
                       device=input_ids.device).reshape(len(generated), width)
    if encoder_decoder:
        start = config.decoder_start_token_id
        start = start if start is not None else model.config.decoder_start_token_id
        sequences = torch.cat([torch.full((len(generated), 1), start, dtype=torch.long, device=input_ids.device), new], 1)
    else:
        sequences = torch.cat([input_ids.long().repeat_interleave(n, dim=0), new], dim=1)
    if not config.return_dict_in_generate:
        return sequences
    from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput

    return (GenerateEncoderDecoderOutput if encoder_decoder else GenerateDecoderOnlyOutput)(sequences=sequences)
