"""A/B of the per-token stop's confidence under greedy decoding: the one-hot q (old) against the drafter's softmax
(new), alternated per prompt in one process; SD with the 0.5B and the self-drafter; speedups against our plain."""
import json, math, statistics, sys, time
from benchmarks.prompts import encode, load_workload
from sampling import autoregressive_generate, quantized_drafter, speculative_generate, SpeculativeStats
from sampling.drafters.model_drafter import ModelDrafter
from utils.loading import end_token_ids, load_model
N = int(sys.argv[1]) if len(sys.argv) > 1 else 64
repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 2
t, tok = load_model("qwen2.5-coder-1.5b-instruct")
d05, _ = load_model("qwen2.5-coder-0.5b-instruct")
selfd = quantized_drafter(t)
end = end_token_ids(t, tok)
prompts = [(task, encode(tok, text)) for task, text in load_workload("spec_bench", 1)]
new = ModelDrafter._confidence
def old(self, logits, q, draft, history):
    return float(q[draft])
variants = {"old": old, "new": new}
times = {}; taus = {}
def run(key, f):
    s = time.perf_counter(); out = f(); e = time.perf_counter() - s
    times.setdefault(key, []).append(e); return out
for rep in range(repeats + 1):  # the first round warms up
    for task, ids in prompts:
        ref = run(("plain", task), lambda: autoregressive_generate(ids, t, max_gen_len=N, end_tokens_id=end))
        for method, drafter in (("sd", d05), ("self", selfd)):
            order = ("old", "new") if rep % 2 else ("new", "old")
            for v in order:
                ModelDrafter._confidence = variants[v]
                st = SpeculativeStats()
                out, _ = run((method + "_" + v, task), lambda: speculative_generate(ids, drafter, t, gamma=4, adaptive_gamma=True, max_gen_len=N, end_tokens_id=end, stats=st))
                taus.setdefault((method + "_" + v, task), []).append(st.tau)
                assert list(out) == list(ref), (method, v, task)
        if rep == 0:
            for k in list(times): times[k].clear()
            for k in list(taus): taus[k].clear()
tasks = [task for task, _ in prompts]
print("per task speedup against our plain (median over repeats of time ratios) and tau:")
res = {}
for m in ("sd_old", "sd_new", "self_old", "self_new"):
    sp = [statistics.median(p / x for p, x in zip(times[("plain", task)], times[(m, task)])) for task in tasks]
    res[m] = sp
    print(f"{m:9s}", " ".join(f"{task[:10]} {s:.2f}x tau {statistics.mean(taus[(m, task)]):.2f};" for task, s in zip(tasks, sp)),
          f"| geo-mean {math.exp(statistics.mean(map(math.log, sp))):.3f}x, total time {sum(sum(times[(m, task)]) for task in tasks):.1f} s vs plain {sum(sum(times[('plain', task)]) for task in tasks):.1f} s")
for m in ("sd", "self"):
    r = [n / o for n, o in zip(res[m + "_new"], res[m + "_old"])]
    print(m, "new/old per task", [round(x, 3) for x in r], "geo-mean", round(math.exp(statistics.mean(map(math.log, r))), 3))
