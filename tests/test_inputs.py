"""The inputs a transformers user passes: a 1-D tensor is one sequence; a 2-D tensor, a list of lists
or a BatchEncoding/dict with input_ids (and an attention mask whose padding, left or right, is
removed per row) is a batch. Each gives the very tokens of the token-id lists it stands for."""

import pytest
import torch
from transformers import BatchEncoding

from ngram_assisted import (
    MultiDynaGram,
    ngram_assisted_speculative_generate,
    ngram_assisted_speculative_generate_encoder_decoder,
)
from sampling import (
    autoregressive_generate,
    autoregressive_generate_encoder_decoder,
    beam_search_generate,
    speculative_generate,
    speculative_generate_encoder_decoder,
)
from tests.models import VOCAB, prompt, tiny_model

ROWS = [prompt(0, length=9), prompt(1, length=5) * 2, prompt(2, length=4)]  # ragged lengths
PAD = VOCAB + 7  # outside the vocabulary: a padded position that reached the model would be refused


def padded(rows: list[list[int]], side: str) -> BatchEncoding:
    """What a tokenizer with padding_side=`side` and return_tensors="pt" returns for `rows`."""
    width = max(map(len, rows))
    ids, mask = [], []
    for row in rows:
        pad = width - len(row)
        ids.append([PAD] * pad + row if side == "left" else row + [PAD] * pad)
        mask.append([0] * pad + [1] * len(row) if side == "left" else [1] * len(row) + [0] * pad)
    return BatchEncoding({"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)})


def decoders(name: str, **extra):
    """(label, function of inputs) for every decoding function of this model kind, greedy, 8 tokens
    (`extra`: more keyword arguments for every one, e.g. pad_token_id)."""
    target, drafter = tiny_model(name, seed=0), tiny_model(name, seed=1)
    common = dict(max_gen_len=8, **extra)
    if name == "t5":
        return [("ar", lambda x: autoregressive_generate_encoder_decoder(x, target, **common)),
                ("sd", lambda x: tokens(speculative_generate_encoder_decoder(x, drafter, target, gamma=3, **common))),
                ("nasd", lambda x: tokens(ngram_assisted_speculative_generate_encoder_decoder(x, MultiDynaGram(3), target,
                                                                                              **common)))]
    return [("ar", lambda x: autoregressive_generate(x, target, **common)),
            ("beam", lambda x: beam_search_generate(x, target, num_beams=2, **common)),
            ("sd", lambda x: tokens(speculative_generate(x, drafter, target, gamma=3, **common))),
            ("nasd", lambda x: tokens(ngram_assisted_speculative_generate(x, MultiDynaGram(3), target, **common)))]


def tokens(result):
    """The generated ids of a speculative result, without alpha: NASD's draft sizes follow the
    measured costs, which online timings refine between calls (the tokens never change)."""
    return result[0] if isinstance(result, tuple) else [ids for ids, _ in result]


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_tensors_and_tokenizer_outputs_give_the_tokens_of_the_lists(name):
    same = [prompt(3, length=6), prompt(4, length=6)]  # equal lengths: a plain 2-D tensor
    for label, decode in decoders(name):
        one = decode(ROWS[0])
        assert decode(torch.tensor(ROWS[0])) == one, label  # a 1-D tensor: one sequence, one result
        assert decode({"input_ids": ROWS[0], "attention_mask": [1] * len(ROWS[0])}) == one, label  # tokenizer(text)
        assert decode(torch.tensor([ROWS[0]])) == [one], label  # [1, n]: a batch of one, a list back
        assert decode(BatchEncoding({"input_ids": torch.tensor([ROWS[0]])})) == [one], label
        assert decode(torch.tensor(same)) == decode(same), label
        batch = decode(ROWS)
        assert decode(padded(ROWS, "left")) == batch, label
        assert decode(padded(ROWS, "right")) == batch, label
        encoding = padded(ROWS, "left")
        assert decode({"input_ids": encoding["input_ids"].tolist(), "attention_mask": encoding["attention_mask"]}) == batch


@pytest.fixture
def no_forward(monkeypatch):
    from utils.runners.passes import ModelPasses

    def forbidden(*args, **kwargs):
        raise AssertionError("a model ran before the input was checked")

    monkeypatch.setattr(ModelPasses, "run", forbidden)  # every pass of every runner, batches included


BAD = [
    ({"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.tensor([[1, 1]])}, "must have the shape"),
    ({"input_ids": torch.tensor([5, 6, 7]), "attention_mask": torch.tensor([[1, 1, 1]])}, "must have the shape"),
    ({"input_ids": [[5, 6], [7, 8, 9]], "attention_mask": [[1, 1, 0], [1, 1, 1]]}, "must have the shape"),
    ({"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.tensor([[1, 0, 1]])}, "a 0 at position 1"),
    ({"input_ids": torch.tensor([[5, 6, 7], [5, 6, 7]]), "attention_mask": torch.tensor([[1, 1, 1], [0, 0, 0]])},
     r"attention_mask'\]\[1\] is all zeros"),
    ({"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.tensor([[2, 1, 1]])}, "only 0 .padding. and 1"),
    ({"attention_mask": torch.tensor([[1, 1]])}, "without 'input_ids'"),
    ({"input_ids": torch.tensor([[5, VOCAB]]), "attention_mask": torch.tensor([[1, 1]])}, r"input_ids'\]\[0\] holds"),
    (torch.zeros(1, 2, 3, dtype=torch.long), "1-D tensor .one sequence. or a 2-D tensor"),
    (torch.zeros(0, 3, dtype=torch.long), "at least one row"),
]


@pytest.mark.parametrize("inputs,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_a_bad_mask_or_shape_gets_a_clear_error_before_any_forward(no_forward, inputs, message):
    model = tiny_model("llama")
    for decode in (lambda x: autoregressive_generate(x, model), lambda x: beam_search_generate(x, model),
                   lambda x: ngram_assisted_speculative_generate(x, MultiDynaGram(3), model)):
        with pytest.raises(ValueError, match=message):
            decode(inputs)



# A padded batch without its mask: stripped by pad_token_id, refused without it (never decoded as text).

def without_mask(rows: list[list[int]], side: str, pad: int) -> torch.Tensor:
    """`tok(texts, padding=True, return_tensors="pt")["input_ids"]`: the ids alone, padded with `pad`."""
    width = max(map(len, rows))
    return torch.tensor([[pad] * (width - len(r)) + r if side == "left" else r + [pad] * (width - len(r)) for r in rows])


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_a_padded_tensor_without_its_mask_is_stripped_by_pad_token_id(name):
    references = [decode(ROWS) for _, decode in decoders(name)]
    for pad in (0, 2, PAD):  # the tiny models' pad token, their end token (GPT-2 pads with it), any token
        for (label, decode), batch in zip(decoders(name, pad_token_id=pad), references, strict=True):
            for side in ("left", "right"):
                assert decode(without_mask(ROWS, side, pad)) == batch, (label, pad, side)
            assert decode(without_mask(ROWS, "right", pad).tolist()) == batch, label  # lists padded alike
            assert decode(padded(ROWS, "left")) == batch, label  # a mask, when given, decides


@pytest.mark.parametrize("pad, side", [(0, "left"), (0, "right"), (2, "right"), (2, "left")])
def test_a_padded_tensor_without_mask_or_pad_token_id_is_refused(no_forward, pad, side):
    model = tiny_model("llama")
    inputs = without_mask(ROWS, side, pad)
    for decode in (lambda x: autoregressive_generate(x, model), lambda x: beam_search_generate(x, model),
                   lambda x: speculative_generate(x, model, model),
                   lambda x: ngram_assisted_speculative_generate(x, MultiDynaGram(3), model)):
        for form in (inputs, inputs.tolist(), {"input_ids": inputs}):
            with pytest.raises(ValueError, match=f"without an attention mask.*token {pad} .*looks padded.*"
                                                 f"pad_token_id={pad}"):
                decode(form)


def test_a_batch_of_equal_rows_without_pad_evidence_is_decoded_as_it_is():
    model = tiny_model("llama")
    rows = [prompt(3, length=6), prompt(4, length=6)]
    ends = [[2] + rows[0] + [2], [2] + rows[1] + [2]]  # every row begins and ends with one end token: text
    for batch in (rows, ends):
        assert autoregressive_generate(torch.tensor(batch), model, max_gen_len=4) == \
            [autoregressive_generate(row, model, max_gen_len=4) for row in batch]
    ragged = [rows[0] + [0, 0], rows[1]]  # rows of different lengths were not padded: taken as they are
    assert autoregressive_generate(ragged, model, max_gen_len=4)[1] == autoregressive_generate(rows[1], model, max_gen_len=4)


def test_pad_token_id_is_checked(no_forward):
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="pad_token_id must be an int"):
        autoregressive_generate(torch.tensor(ROWS[:1]), model, pad_token_id="0")
    with pytest.raises(ValueError, match=r"inputs\[1\] is all padding \(pad_token_id=0\)"):
        autoregressive_generate(torch.tensor([[5, 6], [0, 0]]), model, pad_token_id=0)
