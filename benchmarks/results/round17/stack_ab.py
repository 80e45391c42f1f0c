"""Alternated A/B: the lean forward's layers in one native call (decoder.py) against the Python layers."""
import statistics, sys, time, torch
from sampling import quantized_drafter
from utils.calibration import pass_costs
from utils.lean import lean_decoder
from utils.loading import load_model
from utils.runners.static import StaticSequence
CONTEXT = 256
target = load_model("qwen2.5-coder-1.5b-instruct")[0]
drafter = load_model("qwen2.5-coder-0.5b-instruct")[0]
models = {"1.5B": target, "0.5B": drafter}
if "self" in sys.argv:
    models["self"] = quantized_drafter(target)
runners = {}
for label, model in models.items():
    lean = lean_decoder(model)
    print(label, "stack", lean.stack is not None, flush=True)
    r = StaticSequence(model, slots=CONTEXT + 80, costs=None)
    r.forward(list(range(3, 3 + CONTEXT)))
    runners[label] = (lean, r)
def one(lean, r, width, use):
    saved = lean.stack
    if not use: lean.stack = None
    start = time.perf_counter()
    out = r.forward(list(range(10, 10 + width)), num_logits=width)
    s = time.perf_counter() - start
    r.rollback(CONTEXT)
    lean.stack = saved
    return s, out
times = {(l, w, u): [] for l in models for w in (1, 4, 8) for u in (True, False)}
for label, (lean, r) in runners.items():
    for w in (1, 4, 8):
        a, b = one(lean, r, w, True)[1], one(lean, r, w, False)[1]
        print(label, w, "logits equal", torch.equal(a, b), (a.float() - b.float()).abs().max().item(), flush=True)
for round_ in range(8):
    for label, (lean, r) in runners.items():
        for w in (1, 4, 8):
            for u in ((True, False) if round_ % 2 else (False, True)):
                s = one(lean, r, w, u)[0]
                if round_: times[(label, w, u)].append(s)
for label in models:
    for w in (1, 4, 8):
        on, off = times[(label, w, True)], times[(label, w, False)]
        print(f"{label} width {w}: stack {1000*statistics.median(on):.1f} ms, python layers {1000*statistics.median(off):.1f} ms, "
              f"ratio {statistics.median([a/b for a, b in zip(on, off)]):.3f} (range {min(a/b for a,b in zip(on,off)):.3f}-{max(a/b for a,b in zip(on,off)):.3f})")
