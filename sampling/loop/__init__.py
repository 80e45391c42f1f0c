"""The speculative loop and what it is made of: the request and its checks (`common.py`, `habits.py`,
`stopping.py`, `vocabularies.py`), the options (`options.py`), the loop (`speculative_loop.py`), what it knows of
a drafter (`drafts.py`), acceptance of chains and trees (`acceptance.py`, `tree_sampling.py`), its bookkeeping
(`progress.py`, `step_clock.py`, `logprobs.py`) and the random numbers it draws (`randomness.py`)."""
