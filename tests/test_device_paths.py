"""Paths a GPU user takes, checked on the CPU as far as a CPU can: float64 only where the device has it
(the capability patched off, as on MPS), timings that wait for every device before and after the
clock, each cache layer indexed on its own device, and the one-sync speculative rule equal to the
paper's rule step for step."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import sampling.loop.acceptance
import sampling.loop.randomness
import utils.logits_processors
import utils.runners.compat
import utils.runners.passes
from sampling.loop.acceptance import speculative_rows
from sampling.loop.drafts import DraftTree
from sampling.loop.randomness import ACCEPT, TARGET, PositionUniforms
from tests.models import prompt, tiny_model
from utils.logits_processors import NucleusProcessor, inverse_cdf, supports_float64
from utils.runners import SequenceRunner, make_runner
from utils.runners.model_info import model_devices
from utils.runners.passes import synchronize


def speculative_accept(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, uniforms: PositionUniforms,
                       position: int) -> tuple[int, int]:
    """One chain through the library's batched rule (`speculative_rows`) -> (n, next token)."""
    n, token = speculative_rows(p, [0], [DraftTree.chain(drafts.tolist())], [q], [uniforms], [position])
    n, token = torch.cat([n, token]).tolist()
    return n, token


def test_mps_is_the_device_without_float64():
    assert not supports_float64("mps") and not supports_float64(torch.device("mps"))
    assert supports_float64("cpu") and supports_float64(torch.device("cuda", 1)) and supports_float64("xpu")


class NoFloat64(TorchDispatchMode):
    """Fails on any operation that makes a float64 tensor."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            assert not (isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float64), f"{func} made float64"
        return out


class Float32Uniforms:
    """PositionUniforms' interface with float32 numbers: what a device without float64 is handed."""

    def __init__(self, seed: int) -> None:
        self.table = torch.rand(64, 3, generator=torch.Generator().manual_seed(seed))

    def __call__(self, position, stream=TARGET):
        return float(self.table[position, stream])

    def span(self, start, count, stream):
        return self.table[start : start + count, stream]


@pytest.fixture
def without_float64(monkeypatch):
    for module in (utils.logits_processors, sampling.loop.acceptance, sampling.loop.randomness):
        monkeypatch.setattr(module, "supports_float64", lambda device: False)


def test_sampling_makes_no_float64_where_the_device_lacks_it_and_keeps_the_rule(without_float64):
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(200, 50, generator=g).masked_fill(torch.rand(200, 50, generator=g) < 0.3, 0.0)
    u = torch.rand(200, generator=g, dtype=torch.float64)
    expected = torch.searchsorted(probs.double().cumsum(-1), (u * probs.double().sum(-1))[:, None], right=True)[:, 0]
    p = torch.rand(4, 50, generator=g).softmax(-1)
    q = torch.rand(3, 50, generator=g).softmax(-1)
    with NoFloat64():
        tokens = inverse_cdf(probs, u)  # float64 numbers in, float32 arithmetic
        one = inverse_cdf(probs[0], 0.5)
        sampled = NucleusProcessor(temperature=1.0, top_p=0.9).sample(probs, torch.Generator().manual_seed(1))
        n, token = speculative_accept(p, q, torch.tensor([3, 7, 9]), Float32Uniforms(0), 0)
    assert torch.equal(tokens, expected)  # the same rule (50 tokens: no draw lands within float32 rounding)
    assert probs[torch.arange(200), tokens].gt(0).all() and probs[torch.arange(200), sampled].gt(0).all()
    assert 0 <= int(one) < 50 and 0 <= n <= 3 and p[n, token] > 0


def test_a_generator_on_a_device_without_float64_draws_float32_numbers(without_float64):
    uniforms = PositionUniforms(torch.Generator().manual_seed(0))
    assert 0.0 <= uniforms(5) < 1.0 and uniforms.span(0, 4, ACCEPT).dtype == torch.float64  # kept on the host in float64
    again = PositionUniforms(torch.Generator().manual_seed(0))
    assert torch.equal(uniforms.span(0, 64, TARGET), again.span(0, 64, TARGET))


def reference_accept(p, q, drafts, uniforms, position):
    """Leviathan et al. 2023, Algorithm 1, as it was written before its syncs were folded into one."""
    k = len(drafts)
    rows = torch.arange(k)
    r = uniforms.span(position, k, ACCEPT).to(p.dtype)
    n = int((r * q[rows, drafts] < p[rows, drafts]).long().cumprod(0).sum())
    if n == k:
        return n, int(inverse_cdf(p[k], uniforms(position + k, TARGET)))
    residual = (p[n] - q[n]).clamp(min=0)
    residual = residual if residual.sum() > 0 else p[n]
    return n, int(inverse_cdf(residual, uniforms(position + n, TARGET)))


def test_the_one_sync_speculative_rule_is_the_papers_rule_step_for_step():
    g = torch.Generator().manual_seed(0)
    seen = set()
    for case in range(300):
        k, vocab = 1 + case % 4, 6
        p = (torch.randn(k + 1, vocab, generator=g, dtype=torch.float64) * 2).softmax(-1)
        q = p[:k].clone() if case % 7 == 0 else (torch.randn(k, vocab, generator=g, dtype=torch.float64) * 2).softmax(-1)
        drafts = torch.multinomial(q, 1, generator=g)[:, 0]
        uniforms = PositionUniforms(torch.Generator().manual_seed(case))
        before = (p.clone(), q.clone())
        result = speculative_accept(p, q, drafts, uniforms, 3)
        assert result == reference_accept(p, q, drafts, uniforms, 3)
        assert torch.equal(p, before[0]) and torch.equal(q, before[1])  # pure
        seen.add(result[0] == k)
    assert seen == {True, False}  # both the bonus token and rejections were met


def test_synchronize_waits_for_every_accelerator_it_is_given(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("cuda", device)))
    monkeypatch.setattr(torch.xpu, "synchronize", lambda device=None: calls.append(("xpu", device)))
    monkeypatch.setattr(torch.mps, "synchronize", lambda: calls.append(("mps", None)))
    synchronize(torch.device("cuda", 1), torch.device("cpu"), torch.device("xpu", 0), torch.device("mps"),
                torch.device("cuda", 0))
    assert calls == [("cuda", torch.device("cuda", 1)), ("xpu", torch.device("xpu", 0)), ("mps", None),
                     ("cuda", torch.device("cuda", 0))]
    assert model_devices(tiny_model("llama")) == (torch.device("cpu"),)


def test_a_timed_pass_starts_the_clock_after_the_queued_work(monkeypatch):
    from utils.calibration import pass_costs

    model = tiny_model("llama")
    runner = SequenceRunner(model, costs=pass_costs(model))
    runner.forward(prompt(0, length=8))  # the prefill is not timed
    events = []

    class Clock:
        @staticmethod
        def perf_counter():
            events.append("clock")
            return float(len(events))

    monkeypatch.setattr(utils.runners.passes, "synchronize", lambda *devices: events.append(("sync", devices)))
    monkeypatch.setattr(utils.runners.passes, "time", Clock)
    runner.forward([5, 6])
    assert events == [("sync", runner.devices), "clock", ("sync", runner.devices), "clock"]


def test_every_cache_layer_is_indexed_on_its_own_device(monkeypatch):
    """A model split by device_map keeps layers on several devices: keep_path, _compact and
    select_rows index each layer with an index on that layer's device (copied once per device)."""
    model = tiny_model("llama")
    asked = []
    original = utils.runners.compat._index_on

    def recording(index, device, copies):
        asked.append(device)
        return original(index, device, copies)

    monkeypatch.setattr(utils.runners.compat, "_index_on", recording)
    runner = SequenceRunner(model)
    runner.forward(prompt(1, length=6))
    runner.forward_tree(7, [8, 9, 10], [-1, -1, 1])  # root, two children, a grandchild under the second
    runner.keep_path(6, [1, 2])  # not contiguous: the path's keys and values move
    layers = list(runner._cache.layers)
    assert asked == [layer.keys.device for layer in layers]
    asked.clear()
    batch = make_runner(model, rows=2)
    batch.forward_rows([(prompt(2, length=5), None), (prompt(3, length=9), None)], [1, 1])
    batch.forward_rows([([4, 5], None), ([6], None)], [1, 1])
    batch = batch.select_rows([1])  # one row left: the rows' slots are compacted too
    layers = list(batch._cache.layers)
    assert asked == [d for layer in layers for d in (layer.keys.device, layer.values.device)] + \
        [layer.keys.device for layer in layers]


def test_the_benchmarks_honour_device(tmp_path, monkeypatch):
    """`--device cpu` reaches load_model, and transformers' baselines get their ids on the model's device."""
    from benchmarks import spec_bench, throughput
    from tests.saved_model import save_tiny_chat_model

    model = save_tiny_chat_model(tmp_path / "model", max_positions=2048)
    asked, fed = [], []
    for module in (spec_bench, throughput):
        real = module.load_model
        monkeypatch.setattr(module, "load_model", lambda *a, real=real, **k: asked.append(k.get("device")) or real(*a, **k))
        monkeypatch.setattr(module, "input_device", lambda m: fed.append(m.device) or m.device)
    spec_bench.main(["--workload", "humaneval", "--model", str(model), "--per-category", "1", "--repeats", "1",
                     "--max-new-tokens", "4", "--methods", "hf_plain,ours_ar", "--device", "cpu",
                     "--out", str(tmp_path / "sb"), "--quiet"])
    throughput.main(["--workload", "humaneval", "--model", str(model), "--prompts", "2", "--batch-sizes", "2",
                     "--max-new-tokens", "4", "--repeats", "1", "--device", "cpu", "--out", str(tmp_path / "tp"), "--quiet"])
    assert asked and set(asked) == {"cpu"}
    assert fed and set(fed) == {torch.device("cpu")}
