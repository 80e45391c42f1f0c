"""How much to draft, and in what shape: the draft-length policy (`draft_policy.py`), the drafter's
confidence stop (`draft_confidence.py`), chains against trees (`tree_choice.py`) and the running estimates they
read (`estimators.py`)."""
