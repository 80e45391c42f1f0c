"""The drafter kinds, each registered by one file, and the registry that routes a request to one (`registry.py`,
`drafter_kinds.py`): a drafter model (`model_kind.py`, with `model_drafter.py`, `model_tree.py`), a drafter with
another tokenizer (`universal.py`), prompt lookup before it (`cascade.py`), n-grams and a model together
(`hybrid.py`), your own drafter (`custom_drafters.py`) and the target's own weights in four bits
(`self_drafting.py`, `self_bits.py`). NASD's kind lives in `ngram_assisted/`."""
