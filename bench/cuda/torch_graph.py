#!/usr/bin/env python3
"""The torch op captured in a CUDA graph against the C API's step, one process.

    python bench/cuda/torch_graph.py --out OUTDIR [--tokens 8192] [--reps 7]

The seeds' headline shape by default (B = 1, T = 8192, H = 4096, V = 151936,
bf16; --quick: H = 1024, V = 32000): hidden ~ N(0, 1), weight ~ N(0, 1)/sqrt(H),
random ids, ~90% of the tokens unmasked, DAPO with beta 0.04, old and
reference log-probs within ~0.1 of the policy's own (one linear_logprobs
call makes them), forward and backward to grad_hidden and grad_weight in bf16.

Rows, each the median [min, max] of --reps timed steps after 2 warm-ups, host
wall time between two synchronisations of the device:
  floor       torch.mm x3 in bf16 at full shape (logits [N, V], grad_hidden,
              grad_weight): every ratio's denominator but the last column's;
  C API       fg_linear_grpo through ctypes on torch's tensors and stream
              (host-checked: the library's own waits inside), the outputs
              allocated once;
  torch op    fusedgrpo.torch.linear_grpo, eager (host-checked);
  graph       fusedgrpo.torch.linear_grpo_reported (device_report) captured
              once with torch.cuda.graph, timed as replays, then
              raise_device_errors() (it must raise nothing);
and "graph / C API", the issue's ratio for a captured step (target <= 1.02).
--device cpu runs the rows it can on the CPU (the floor, the C API and the
torch op; the graph needs CUDA): a check of the script, not a measurement.
Writes OUTDIR/torch_graph.json and OUTDIR/torch_graph.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    if a.reps < 5:
        ap.error("--reps: at least 5 (a median of 5 or more steps)")

    import torch
    from fusedgrpo import _lib, _options
    from fusedgrpo import _torch_inputs as ti
    import fusedgrpo.torch as fgt

    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("skipped: torch sees no CUDA device")
        return 77
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    B, T = 1, a.tokens
    H, V = (1024, 32000) if a.quick else (4096, 151936)
    N = B * T
    bf = torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(20261203)
    h = torch.randn(B, T, H, generator=g).to(dev, bf)
    w = (torch.randn(V, H, generator=g) / H ** 0.5).to(dev, bf)
    tok = torch.randint(0, V, (B, T), generator=g).to(dev)
    mask = (torch.rand(B, T, generator=g) < 0.9).to(dev)
    adv = torch.randn(B, generator=g).to(dev)
    with torch.no_grad():
        logp = fgt.linear_logprobs(h, w, tok, mask)
    old = (logp + 0.1 * torch.randn(B, T, generator=g).to(dev)).float()
    ref = (logp - 0.05).float()
    opts = dict(loss_type="dapo", beta=0.04)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def timed(fn, warmups=2):
        for _ in range(warmups):
            fn()
        ts = []
        for _ in range(a.reps):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t0)
        return {"median_ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts),
                "max_ms": 1e3 * max(ts)}

    rows = []
    z = torch.empty(N, V, dtype=bf, device=dev)
    h2 = h.reshape(N, H)

    def floor():
        torch.mm(h2, w.T, out=z)
        torch.mm(z, w)
        torch.mm(z.T, h2)

    rows.append(("floor", "torch.mm x3, bf16, full shape", timed(floor)))

    # The C API: one fg_linear_grpo on torch's tensors, outputs made once.
    keep, req = ti.head_args(h, w, tok, mask, None)
    advf, oldf, reff = adv.float(), old, ref
    f32 = torch.float32
    out_lp = torch.empty(B, T, dtype=f32, device=dev)
    out_ent = torch.empty(B, T, dtype=f32, device=dev)
    gh = torch.empty(B, T, H, dtype=bf, device=dev)
    gw = torch.empty(V, H, dtype=bf, device=dev)
    cfg = _options.loss_config(opts)
    ex = _options.make_exec(None, None)
    ctx = ti.call_context(dev)
    p = ti.ptr

    def c_api():
        _lib.linear_call(cfg, "fused", ex, ctx=ctx, **req, advantages=p(advf), old_logp=p(oldf),
                         ref_logp=p(reff), is_ratio=0, is_ratio_per_sequence=False,
                         sampling_logp=0, logp=p(out_lp), entropy=p(out_ent), grad_hidden=p(gh),
                         grad_weight=p(gw), grad_bias=0,
                         grad_dtypes=(ti.dtype_id(bf), ti.dtype_id(bf), ti.dtype_id(bf)),
                         filter_eps=0.0)

    t_c = timed(c_api)
    rows.append(("C API", "fg_linear_grpo via ctypes, host-checked", t_c))

    def torch_op():
        fgt.linear_grpo(h, w, tok, mask, adv, None, old, ref, **opts)

    rows.append(("torch op", "fusedgrpo.torch.linear_grpo, eager, host-checked",
                 timed(torch_op)))

    t_g = None
    if dev.type == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fgt.linear_grpo_reported(h, w, tok, mask, adv, None, old, ref, **opts)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fgt.linear_grpo_reported(h, w, tok, mask, adv, None, old, ref, **opts)
        t_g = timed(graph.replay)
        fgt.raise_device_errors()
        fgt.forget_graph_reports()
        rows.append(("graph", "linear_grpo_reported in torch.cuda.graph, replays", t_g))

    floor_ms = rows[0][2]["median_ms"]
    device = (torch.cuda.get_device_name(dev) if dev.type == "cuda"
              else platform.processor() or "cpu")
    res = {"device": device, "shape": dict(B=B, T=T, H=H, V=V, unmasked=int(mask.sum())),
           "torch": torch.__version__, "command": " ".join([sys.executable] + sys.argv),
           "rows": [dict(row=r, what=wh, ratio_to_floor=t["median_ms"] / floor_ms, **t)
                    for r, wh, t in rows],
           "graph_over_c_api": (t_g["median_ms"] / t_c["median_ms"]) if t_g else None}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "torch_graph.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = [f"# The torch op in a CUDA graph against the C API ({device})", "",
             f"B {B}, T {T}, H {H}, V {V}, bf16, {res['shape']['unmasked']} tokens unmasked; "
             f"median of {a.reps} after 2 warm-ups; `{res['command']}`", "",
             "| row | what | median ms [min, max] | x floor |", "| --- | --- | ---: | ---: |"]
    for r in res["rows"]:
        lines.append(f"| {r['row']} | {r['what']} | {r['median_ms']:.2f} [{r['min_ms']:.2f}, "
                     f"{r['max_ms']:.2f}] | {r['ratio_to_floor']:.3f} |")
    if t_g:
        lines += ["", f"graph / C API: {res['graph_over_c_api']:.3f} (target <= 1.02)"]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "torch_graph.md"), "w") as f:
        f.write(text)
    print(text)
    del keep
    return 0


if __name__ == "__main__":
    sys.exit(main())
