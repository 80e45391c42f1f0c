"""The self-drafter in 4-bit groups of 32 against groups of 64: its one-token pass against the target's (alternated
in one process) and its tau at a fixed gamma (greedy; Spec-Bench and HumanEval dev prompts, 64 tokens)."""
import statistics, time, torch
from benchmarks.prompts import encode, load_workload
from sampling import SpeculativeStats, quantized_drafter, speculative_generate
from utils.loading import end_token_ids, load_model
from utils.runners.model_info import pass_bytes
from utils.runners.static import StaticSequence
target, tok = load_model("qwen2.5-coder-1.5b-instruct")
end = end_token_ids(target, tok)
drafters = {"g32": quantized_drafter(target, group_size=32), "g64": quantized_drafter(target, group_size=64)}
print({k: round(pass_bytes(d) / pass_bytes(target), 4) for k, d in drafters.items()}, flush=True)
texts = load_workload("spec_bench", 1)[:6] + load_workload("humaneval", 4)[:4]
with torch.no_grad():
    for name, d in drafters.items():
        taus = []
        for task, text in texts:
            stats = SpeculativeStats()
            speculative_generate(encode(tok, text), d, target, gamma=5, max_gen_len=64, end_tokens_id=end, stats=stats)
            taus.append(round(stats.tau, 2))
        print(name, "tau", taus, "mean", round(statistics.mean(taus), 3), flush=True)
models = {"target": target, **drafters}
runners = {}
for k, m in models.items():
    r = StaticSequence(m, slots=400, costs=None); r.forward(list(range(3, 259))); runners[k] = r
times = {k: [] for k in models}
for i in range(9):
    for k, r in runners.items():
        s = time.perf_counter(); r.forward([10], num_logits=1); times[k].append(time.perf_counter() - s); r.rollback(256)
for k in ("g32", "g64"):
    ratios = [a / b for a, b in zip(times[k][1:], times["target"][1:])]
    print(k, f"pass {1000*statistics.median(times[k][1:]):.1f} ms, of the target's {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
print("target", f"{1000*statistics.median(times['target'][1:]):.1f} ms")
