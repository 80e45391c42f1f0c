import statistics, time, torch
from benchmarks.passes import read_bandwidth
from sampling import quantized_drafter
from utils.loading import load_model
from utils.runners.model_info import pass_bytes
from utils.runners.static import StaticSequence
target, tok = load_model("qwen2.5-coder-1.5b-instruct")
models = {"target": target, "g32": quantized_drafter(target, group_size=32), "g64": quantized_drafter(target, group_size=64)}
runners = {}
for k, m in models.items():
    r = StaticSequence(m, slots=400, costs=None); r.forward(list(range(3, 259))); runners[k] = r
times = {k: [] for k in models}; bws = []
for i in range(11):
    bws.append(read_bandwidth(repeats=2))
    for k, r in runners.items():
        s = time.perf_counter(); r.forward([10], num_logits=1); times[k].append(time.perf_counter() - s); r.rollback(256)
bw = statistics.median(bws[1:])
print(f"sum {bw/1e9:.1f} GB/s ({min(bws[1:])/1e9:.1f}-{max(bws[1:])/1e9:.1f})")
for k in models:
    ratios = [a / b for a, b in zip(times[k][1:], times["target"][1:])]
    ms = statistics.median(times[k][1:])
    print(f"{k}: {1000*ms:.1f} ms, of its bound {pass_bytes(models[k])/bw/ms:.2f}, of the target's {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
