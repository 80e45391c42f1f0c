"""Measured cost tables (a pass over 1 + k tokens / a one-token pass), to test the draft policies
under a machine's costs whatever machine runs the tests."""

import pytest

from sampling.policy.draft_policy import CostAwareDraftLength
from sampling.policy.tree_choice import TreePlanner
from utils.cost_model import PassCosts

# Qwen2.5-Coder-1.5B and 0.5B in bfloat16, AMD EPYC Zen 5 with AVX512_BF16 (issue 34).
BF16_15B = {0: 1.0, 8: 1.0, 12: 1.11, 16: 1.19, 24: 1.40, 31: 1.64}
BF16_05B = {0: 1.0, 3: 1.0, 4: 1.04, 6: 1.11, 8: 1.16, 12: 1.26, 16: 1.41}
# Qwen2.5-Coder-1.5B in float32 on an AVX2-only CPU: a pass over 5 tokens 1.40x, over 9 tokens 2.08x.
AVX2_FP32 = {0: 1.0, 4: 1.40, 8: 2.08}


def fix_costs(monkeypatch: pytest.MonkeyPatch, relative: dict[int, float], drafter_step_cost: float) -> None:
    """Every model's passes cost `relative`, a drafted token (and a drafter model's one-token pass)
    `drafter_step_cost` of a target pass, and no timing moves either: the policies decide the same on
    a quiet machine and a busy one."""
    def costs(model, seconds: float = 0.1):
        return PassCosts(relative=dict(relative), one_token_seconds=seconds, measured=True)

    monkeypatch.setattr("sampling.loop.common.pass_costs", costs)
    monkeypatch.setattr("sampling.drafters.model_kind.pass_costs", lambda model: costs(model, 0.1 * drafter_step_cost))
    monkeypatch.setattr(PassCosts, "observe", lambda self, k, seconds: None)
    monkeypatch.setattr(PassCosts, "observe_batch", lambda self, rows, width, seconds: None)
    monkeypatch.setattr(CostAwareDraftLength, "drafter_step_cost", lambda self: drafter_step_cost)
    monkeypatch.setattr(TreePlanner, "observe_drafting", lambda self, seconds, passes, rows: None)
