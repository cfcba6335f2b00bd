#!/usr/bin/env python3
"""Gradient filtering's speed against its error, on real LM-head inputs
(what a threshold buys in speed and costs in gradient error).

    python bench/capture_smollm2.py --out /tmp/smollm2_capture
    python bench/filter_curve.py --inputs /tmp/smollm2_capture --dtype bfloat16 \
        --json bench/results/gradient_filtering/avx2/filter_curve_bf16.jsonl

For each threshold (0 = off, then --eps), one NumPy-front-end call per step
(fusedgrpo.fused_linear_grpo: one C call, forward and backward), a warm-up
step and --steps timed ones: median [min, max] of the step, the share of
d loss/d logits the backward products used (memory_stats), and the gradients'
relative L2 error against the exact gradient: the float32 fused call on the
same inputs (for bf16, the inputs rounded to bf16 and passed as float32, so
the reference sees what the bf16 call sees). The materialized baseline runs
in the same process, interleaved with the fused rows, as the speed reference.
The loss options are the A/B's: dapo, beta 0.04 (reference log-probs = old -
0.01), on-policy old log-probs from the capture.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time

import numpy as np


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def onednn_isa() -> str:
    """The ISA oneDNN dispatches on this CPU (its verbose line), from a child."""
    code = ("import numpy as np, fusedgrpo as fg; r = np.random.default_rng(0); "
            "fg.fused_linear_grpo(r.standard_normal((1, 2, 8), np.float32), "
            "r.standard_normal((16, 8), np.float32), np.zeros((1, 2), np.int64), "
            "np.ones((1, 2), bool), np.ones(1, np.float32))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, ONEDNN_VERBOSE="1")).stdout
    m = re.search(r"isa:([^\n]+)", out)
    return m.group(1).strip() if m else "unknown"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--inputs", required=True, help="a capture of bench/capture_smollm2.py")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--eps", default="1e-6,1e-5,3e-5,1e-4,1e-3,1e-2",
                    help="comma-separated thresholds (0, off, always runs first)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", help="one JSON line per row")
    a = ap.parse_args(argv)

    import fusedgrpo as fg
    d = a.inputs
    h, w, tok, mask, adv, old = (np.load(os.path.join(d, f"{n}.npy")) for n in
                                 ("hidden", "weight", "token_ids", "mask", "advantages",
                                  "old_logp"))
    if a.dtype == "bfloat16":  # what the bf16 call sees, as float32
        h, w = (fg.bf16_bits_to_f32(fg.f32_to_bf16_bits(x)) for x in (h, w))
    ref = old - 0.01
    opts = dict(beta=0.04, loss_type="dapo")

    def call(dtype, **kw):
        return fg.fused_linear_grpo(h, w, tok, mask, adv, old, ref, dtype=dtype, **opts, **kw)

    exact = call("float32")

    def timed(**kw):
        call(a.dtype, **kw)  # warm-up: the workspace, the primitives
        ts, r = [], None
        for _ in range(a.steps):
            t0 = time.perf_counter()
            r = call(a.dtype, **kw)
            ts.append(time.perf_counter() - t0)
        return r, fg.memory_stats(), ts

    def rel(x, y):
        return float(np.linalg.norm(x - y) / np.linalg.norm(y))

    head = dict(cpu=cpu_model(), onednn_isa=onednn_isa(), dtype=a.dtype,
                tokens=int(mask.sum()), hidden=int(h.shape[-1]), vocab=int(w.shape[0]),
                steps=a.steps)
    print(f"# {head['cpu']}; oneDNN ISA: {head['onednn_isa']}; {a.dtype}; "
          f"{head['tokens']} tokens, H = {head['hidden']}, V = {head['vocab']}; "
          f"median [min, max] of {a.steps} warm steps")
    rows = []
    base_r, _, base_t = timed(impl="materialized")
    base = statistics.median(base_t)
    rows.append(dict(head, impl="materialized", filter_eps=0.0, step_s_p50=base,
                     step_s_min=min(base_t), step_s_max=max(base_t), kept=1.0,
                     grad_hidden_err=rel(base_r.grad_hidden, exact.grad_hidden),
                     grad_weight_err=rel(base_r.grad_weight, exact.grad_weight)))
    for eps in [0.0] + [float(e) for e in a.eps.split(",") if float(e) > 0]:
        r, st, t = timed(filter_eps=eps)
        assert r.loss == exact.loss or a.dtype == "bfloat16"
        rows.append(dict(head, impl="fused", filter_eps=eps, step_s_p50=statistics.median(t),
                         step_s_min=min(t), step_s_max=max(t),
                         kept=st["dlogits_kept"] / st["dlogits_entries"],
                         grad_hidden_err=rel(r.grad_hidden, exact.grad_hidden),
                         grad_weight_err=rel(r.grad_weight, exact.grad_weight)))
    print("| impl | filter_eps | step s, median [min, max] | speed vs materialized | dlogits kept "
          "| grad_hidden rel. err | grad_weight rel. err |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for x in rows:
        print(f"| {x['impl']} | {x['filter_eps']:g} | {x['step_s_p50']:.3f} [{x['step_s_min']:.3f}, "
              f"{x['step_s_max']:.3f}] | {base / x['step_s_p50']:.2f}x | {100 * x['kept']:.2f}% | "
              f"{x['grad_hidden_err']:.2e} | {x['grad_weight_err']:.2e} |")
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            for x in rows:
                f.write(json.dumps(x) + "\n")


if __name__ == "__main__":
    main()
