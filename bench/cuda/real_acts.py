#!/usr/bin/env python3
"""Gradient filtering on real activations: the fused step on SmolLM2-135M-Instruct's
own completions, dense and filtered, against the three bare products, and the
filter's gradient error against the unfiltered call.

    python bench/capture_smollm2.py --out CAP --device cuda --prompts 16 --generations 8 \\
        --tokens 256                                     # 128 x 256 = 32768 tokens
    python bench/cuda/real_acts.py --inputs CAP --out OUTDIR

scripts/gpu_bench.sh runs both on a GPU session. --device cpu runs the same
rows through the library's CPU backend (a check of the script on a small
capture; the GPU is what it measures).

Inputs: the capture's hidden [B, T, H] and weight [V, H] rounded to bf16 (what
a bf16 policy hands the head), its tokens, mask, advantages and on-policy
old log-probs; reference log-probs old - 0.01; DAPO, beta 0.04 (the options of
bench/filter_curve.py, the CPU's curve).

Rows, one process, each the median [min, max] of --reps timed steps after 2
warm-ups, host wall time between two torch.cuda.synchronize calls:
  floor            torch.mm x3 in bf16 at full shape, bf16 outputs: logits
                   [N, V] = hidden @ weight.T, grad_hidden [N, H] = z @ weight,
                   grad_weight [V, H] = z.T @ hidden (z: the logits buffer
                   standing for dlogits); every ratio divides by it;
  floor, unmasked  the same on the unmasked rows only (what the library
                   multiplies);
  dense            fusedgrpo.torch.linear_grpo (one C call: loss, logp,
                   entropy, grad_hidden, grad_weight in bf16), --budget bytes
                   (default: the backend's, 2 GiB on CUDA);
  filtered         the same with each --filter-eps (default "auto", 1e-5 for
                   bf16, where the CUDA backend's chunks keep too many
                   entries to run sparse, and 2^-12, CCE's threshold, where
                   they run sparse), and the share of dlogits entries its
                   products used (memory_stats: dlogits_kept /
                   dlogits_entries).

The filter's error, filtered against dense (the same call but for the filter,
so the difference is the filter's alone, plus each output's bf16 rounding):
relative L2 of grad_hidden and grad_weight, and docs/LOSS_SPEC.md's bound
per token row r of grad_hidden:
    |gh~_r - gh_r|_2 <= eps * max_v |d_rv| * V * max_v |weight_v|_2
with d_r = g_r (onehot - p_r) (entropy_coef 0), g_r = d loss/d logp_r from
TRL's loss in torch autograd (bench/peers/run_peers.py torch_grpo_loss) and
p_r the float32 softmax of the bf16 logits; each side's bf16 rounding is
allowed 2^-8 of its row norm. "bound holds" is the largest ratio of the
error to bound + rounding being <= 1.
Writes OUTDIR/real_acts.json and OUTDIR/real_acts.md.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def _peers():
    """bench/peers/run_peers.py, for TRL's loss in torch (torch_grpo_loss)."""
    path = os.path.join(HERE, "..", "peers", "run_peers.py")
    spec = importlib.util.spec_from_file_location("run_peers", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--inputs", required=True, help="a capture of bench/capture_smollm2.py")
    ap.add_argument("--out", required=True, help="directory for real_acts.json and .md")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--budget", type=int, default=None, help="memory_budget in bytes")
    ap.add_argument("--filter-eps", default="auto,0.000244140625",
                    help="the filtered rows' thresholds, comma-separated: auto (1e-5 for "
                         "bf16) or numbers (default auto and 2^-12)")
    a = ap.parse_args(argv)
    if a.reps < 5:
        ap.error("--reps: at least 5 (a median of 5 or more steps)")

    import torch
    from fusedgrpo import _lib
    from fusedgrpo.torch import linear_grpo

    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("skipped: torch sees no CUDA device")
        return 77
    cap = {n: np.load(os.path.join(a.inputs, f"{n}.npy")) for n in
           ("hidden", "weight", "token_ids", "mask", "advantages", "old_logp")}
    bf = torch.bfloat16
    h = torch.from_numpy(cap["hidden"]).to(dev, bf)
    w = torch.from_numpy(cap["weight"]).to(dev, bf)
    tok = torch.from_numpy(cap["token_ids"]).to(dev)
    mask = torch.from_numpy(cap["mask"]).to(dev)
    adv = torch.from_numpy(cap["advantages"]).to(dev)
    old = torch.from_numpy(cap["old_logp"]).to(dev)
    ref = old - 0.01
    B, T, H = h.shape
    V = w.shape[0]
    N = B * T
    unmasked = int(mask.sum())
    opts = dict(loss_type="dapo", beta=0.04)
    # "auto" is 1e-5 for bf16 storage (docs/LOSS_SPEC.md, fg_filter_eps_auto):
    # (label, the call's filter_eps, the threshold it means).
    filters = [("auto", -1.0, 1e-5) if x.strip() == "auto" else (f"{float(x):g}", float(x), float(x))
               for x in a.filter_eps.split(",")]

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def timed(fn, reps=a.reps, warmups=2):
        for _ in range(warmups):
            fn()
        ts = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t0)
        return {"median_ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts),
                "max_ms": 1e3 * max(ts)}

    ctx = (_lib.device_context("cuda", torch.cuda.current_stream(dev).cuda_stream)
           if dev.type == "cuda" else _lib.thread_context())
    rows = []

    # The floor: torch.mm in bf16, the logits buffer standing for dlogits.
    h2, z = h.reshape(N, H), torch.empty(N, V, dtype=bf, device=dev)
    rows_unmasked = mask.reshape(N).nonzero().squeeze(1)
    ha = h2.index_select(0, rows_unmasked)

    def three(x, zz):
        torch.mm(x, w.T, out=zz)
        torch.mm(zz, w)
        torch.mm(zz.T, x)

    rows.append(dict(row="floor", what="torch.mm x3, bf16, [N, V] (the floor)",
                     **timed(lambda: three(h2, z))))
    za = z[:unmasked]
    rows.append(dict(row="floor", what="torch.mm x3, unmasked rows only",
                     **timed(lambda: three(ha, za))))
    del z, za

    def call(filter_eps):
        return linear_grpo(h, w, tok, mask, adv, None, old, ref, memory_budget=a.budget,
                           filter_eps=filter_eps, **opts)

    res = {}
    runs = [("dense", 0.0, "fusedgrpo.torch.linear_grpo")] + [
        (f"filtered {label}", fe, "fusedgrpo.torch.linear_grpo, filter_eps " +
         (f"auto = {eps:g}" if label == "auto" else f"{eps:g}")) for label, fe, eps in filters]
    for name, fe, what in runs:
        r = dict(row=name, what=what, **timed(lambda: call(fe)))
        out = call(fe)
        sync()
        st = ctx.memory_stats()
        r["chunks"], r["chunk_rows"] = st["chunks"], st["chunk_rows"]
        if st.get("dlogits_entries"):
            r["kept"] = st["dlogits_kept"] / st["dlogits_entries"]
        r["loss"] = float(out[0])
        res[name] = out
        rows.append(r)
    floor = rows[0]["median_ms"]
    for r in rows:
        r["x_floor"] = r["median_ms"] / floor

    # The spec's per-row bound on grad_hidden, for each threshold.
    peers = _peers()
    c = {"epsilon_low": 0.2, "epsilon_high": 0.2, "beta": 0.04, "loss_type": "dapo"}
    logp = res["dense"][2].detach().clone().requires_grad_()
    loss = peers.torch_grpo_loss(torch, logp, old, ref, mask, adv, c)
    (g,) = torch.autograd.grad(loss, logp)
    g = g.reshape(N)
    dmax = torch.empty(N, device=dev)
    tok2 = tok.reshape(N)
    for r0 in range(0, N, 4096):
        p = torch.softmax((h2[r0:r0 + 4096] @ w.T).float(), dim=-1)
        pt = p.gather(1, tok2[r0:r0 + 4096, None]).squeeze(1)
        p.scatter_(1, tok2[r0:r0 + 4096, None], 0.0)
        dmax[r0:r0 + 4096] = g[r0:r0 + 4096].abs() * torch.maximum(1 - pt, p.max(1).values)
        del p
    wmax = float(w.float().norm(dim=1).max())
    m = mask.reshape(N)
    rel = lambda x, y: float((x - y).norm() / y.norm().clamp(min=1e-30))  # noqa: E731
    gh_d, gw_d = (x.float() for x in res["dense"][4:6])
    errors = {}
    for label, _, eps in filters:  # each filtered call against the dense one
        gh_f, gw_f = (x.float() for x in res[f"filtered {label}"][4:6])
        err = {"eps": eps, "grad_hidden_rel_l2": rel(gh_f, gh_d),
               "grad_weight_rel_l2": rel(gw_f, gw_d)}
        bound = eps * dmax * V * wmax
        diff = (gh_f - gh_d).reshape(N, H).norm(dim=1)
        rounding = 2.0 ** -8 * (gh_d.reshape(N, H).norm(dim=1) + gh_f.reshape(N, H).norm(dim=1))
        ratio = (diff / (bound + rounding).clamp(min=1e-30))[m]
        err["bound_worst_ratio"] = float(ratio.max()) if ratio.numel() else 0.0
        err["bound_holds"] = err["bound_worst_ratio"] <= 1.0
        errors[label] = err

    name = (torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor()
            or platform.machine())
    meta = {"device": name, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "shape": {"B": B, "T": T, "N": N, "H": H, "V": V, "unmasked": unmasked},
            "filter_eps": [label for label, _, _ in filters], "torch": torch.__version__}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "real_acts.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "errors": errors}, f, indent=1)
    lines = [f"Real activations (SmolLM2-135M-Instruct's completions) on {name}, "
             f"{meta['date']}: B={B} T={T} (N={N}, {unmasked} unmasked) H={H} V={V}, bf16, "
             f"DAPO beta 0.04; median of {a.reps} after 2 warm-ups",
             f"`{meta['command']}`", "",
             "| row | what | median (ms) | min | max | x floor | kept | chunks |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        kept = f"{100 * r['kept']:.2f}%" if "kept" in r else ""
        chunks = f"{r['chunks']} of {r['chunk_rows']}" if "chunks" in r else ""
        lines.append(f"| {r['row']} | {r['what']} | {r['median_ms']:.2f} | {r['min_ms']:.2f} "
                     f"| {r['max_ms']:.2f} | {r['x_floor']:.3f} | {kept} | {chunks} |")
    lines.append("")
    for label, err in errors.items():
        lines.append(f"filter_eps {label}: error against the unfiltered call: grad_hidden "
                     f"{err['grad_hidden_rel_l2']:.2e}, grad_weight "
                     f"{err['grad_weight_rel_l2']:.2e} (relative L2); spec bound per row: worst "
                     f"ratio {err['bound_worst_ratio']:.3g} "
                     f"({'holds' if err['bound_holds'] else 'BROKEN'})")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "real_acts.md"), "w") as f:
        f.write(text)
    print(text)
    return 0 if all(e["bound_holds"] for e in errors.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
