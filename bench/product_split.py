#!/usr/bin/env python3
"""Where a step's GEMM time goes, product by product, fused against materialized.

The library counts its GEMM seconds per call (memory_stats()["gemm_seconds"]),
not per product, so this asks for the outputs that make each product run:
no gradients (the logits product alone), grad_hidden only (+ grad_hidden's),
grad_weight only (+ grad_weight's), and both (the step). Every request runs
for both impls in one process, in turns (fused, materialized, then the other
order next round), so drift falls on both alike. Per request and impl: the
median GEMM and call seconds over the rounds; then each backward product's
GEMM seconds as the difference from the forward-only call's. That difference
holds where every request runs the logits product in the same chunks: the
table prints the fused chunks per request.

    PYTHONPATH=python FUSEDGRPO_LIBRARY=build/libfusedgrpo.so.0 \\
        python3 bench/product_split.py --hidden 2048 --dtype float32 --rounds 3
"""
import argparse
import statistics

import numpy as np

import fusedgrpo
from fusedgrpo import _lib

REQUESTS = ("forward", "grad_hidden", "grad_weight", "both")


def call(ops, impl, request, dtype, budget):
    hidden, weight, tok, mask, adv = ops
    operands, req = fusedgrpo._linear_operands(hidden, weight, None, tok, mask, adv, None, None,
                                               None, dtype, None)
    B, T, H, V = (req[k] for k in "BTHV")
    logp, ent = np.empty((B, T), np.float32), np.empty((B, T), np.float32)
    gh = np.empty((B, T, H), np.float32) if request in ("grad_hidden", "both") else None
    gw = np.empty((V, H), np.float32) if request in ("grad_weight", "both") else None
    f32 = _lib.DTYPE_F32
    _lib.linear_call(_lib.make_config(), impl,
                     _lib.make_exec(None, budget), **req, logp=fusedgrpo._ptr(logp), entropy=fusedgrpo._ptr(ent),
                     grad_hidden=fusedgrpo._ptr(gh), grad_weight=fusedgrpo._ptr(gw), grad_bias=0,
                     grad_dtypes=(f32, f32, f32), filter_eps=0.0)
    s = fusedgrpo.memory_stats()
    return s["gemm_seconds"], s["call_seconds"], s["chunks"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=int, default=None, help="bytes (default: the library's)")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((1, a.tokens, a.hidden), dtype=np.float32)
    weight = (rng.standard_normal((a.vocab, a.hidden), dtype=np.float32) * 0.02)
    if a.dtype == "bfloat16":
        hidden, weight = fusedgrpo.f32_to_bf16_bits(hidden), fusedgrpo.f32_to_bf16_bits(weight)
    tok = rng.integers(0, a.vocab, (1, a.tokens), dtype=np.int32)
    ops = (hidden, weight, tok, np.ones((1, a.tokens), np.float32),
           rng.standard_normal(1).astype(np.float32))
    impls = ("fused", "materialized")
    got = {(r, i): [] for r in REQUESTS for i in impls}
    chunks = {}
    for req in REQUESTS:  # one warm call each, not kept
        for i in impls:
            chunks[req, i] = call(ops, i, req, a.dtype, a.budget)[2]
    for k in range(a.rounds):
        for req in REQUESTS:
            for i in (impls if k % 2 == 0 else impls[::-1]):
                got[req, i].append(call(ops, i, req, a.dtype, a.budget)[:2])
    med = statistics.median
    print(f"T={a.tokens} H={a.hidden} V={a.vocab} {a.dtype}, {a.rounds} rounds (medians)")
    print("| request | fused chunks | fused GEMM s | materialized GEMM s | ratio | fused call s "
          "| materialized call s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    g = {}
    for req in REQUESTS:
        f = [med(x[j] for x in got[req, "fused"]) for j in (0, 1)]
        m = [med(x[j] for x in got[req, "materialized"]) for j in (0, 1)]
        g[req] = (f[0], m[0])
        print(f"| {req} | {chunks[req, 'fused']} | {f[0]:.3f} | {m[0]:.3f} | {f[0] / m[0]:.3f} | {f[1]:.3f} | {m[1]:.3f} |")
    print("| product (GEMM s) | fused | materialized | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for name, f, m in (("logits", *g["forward"]),
                       ("grad_hidden", g["grad_hidden"][0] - g["forward"][0],
                        g["grad_hidden"][1] - g["forward"][1]),
                       ("grad_weight", g["grad_weight"][0] - g["forward"][0],
                        g["grad_weight"][1] - g["forward"][1])):
        print(f"| {name} | {f:.3f} | {m:.3f} | {f / m:.3f} |")


if __name__ == "__main__":
    main()
