"""benchmarks/coupling_acceptance.py on tiny models: the rules' acceptance chances and the JSON it writes."""

import json

import torch

from benchmarks.coupling_acceptance import acceptance_chances, main
from tests.saved_model import save_tiny_chat_model


def test_no_coupling_accepts_more_than_the_standard_rule_and_equal_laws_always_agree():
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        p = torch.rand(12, generator=generator, dtype=torch.float64).softmax(0)
        q = (p.log() + torch.randn(12, generator=generator, dtype=torch.float64)).softmax(0)
        chances = acceptance_chances(p, q, 2000, generator)
        assert chances["inverse_cdf"] <= chances["standard"] + 1e-12
        assert chances["gumbel_max"] <= chances["standard"] + 0.05  # Monte Carlo
    same = acceptance_chances(p, p, 100, generator)
    assert abs(same["standard"] - 1) < 1e-12 and abs(same["inverse_cdf"] - 1) < 1e-12 and same["gumbel_max"] == 1.0


def test_the_script_writes_both_rules_for_a_pair(tmp_path):
    folder = save_tiny_chat_model(tmp_path / "tiny")
    out = tmp_path / "coupling.json"
    main(["--target", str(folder), "--drafter", str(folder), "--prompts", "1", "--max-new-tokens", "8",
          "--gamma", "3", "--gumbel-samples", "16", "--out", str(out)])
    result = json.loads(out.read_text())
    assert set(result["alpha"]) == {"standard", "coupled"}
    assert result["alpha"]["coupled"] == 1.0  # the drafter is the target: every coupled draft agrees
    assert result["position_acceptance"]["inverse_cdf"] > 0.999 and result["positions"] > 0


def test_the_script_takes_the_real_pair_by_name(tmp_path, monkeypatch):
    """The names the docs give (offline models) reach load_model with --dtype and --device; the
    tiny model stands in for both, so nothing large is loaded."""
    import pytest

    from benchmarks import coupling_acceptance
    from utils.loading import load_model
    from utils.offline_models import offline_model

    folder = save_tiny_chat_model(tmp_path / "tiny")
    asked = []

    def fake_load(name, dtype=None, device=None, **kwargs):
        asked.append((name, str(dtype), device))
        return load_model(str(folder), dtype=dtype, device=device)

    monkeypatch.setattr(coupling_acceptance, "load_model", fake_load)
    pair = ["--target", "qwen2.5-coder-1.5b-instruct", "--drafter", "qwen2.5-coder-0.5b-instruct"]
    assert all(offline_model(name) is not None for name in pair[1::2])
    result = main(pair + ["--dtype", "float32", "--device", "cpu", "--prompts", "1", "--max-new-tokens", "4",
                          "--gumbel-samples", "4"])
    assert asked == [("qwen2.5-coder-1.5b-instruct", "float32", "cpu"), ("qwen2.5-coder-0.5b-instruct", "torch.float32", "cpu")]
    assert result["target"] == "qwen2.5-coder-1.5b-instruct" and result["dtype"] == "torch.float32"
    assert set(result["tau"]) == {"standard", "coupled"} and all(v >= 1.0 for v in result["tau"].values())
    with pytest.raises(SystemExit):
        main(["--target", "qwen2.5-coder-1.5b-instruct"])  # the drafter is required
