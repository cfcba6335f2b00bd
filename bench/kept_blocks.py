#!/usr/bin/env python3
"""Where gradient filtering's kept entries sit, on real LM-head inputs: the
figure that decides whether a GPU's sparse backward products can beat its
dense ones.

    python bench/capture_smollm2.py --out /tmp/cap --prompts 8 --generations 8 --tokens 256
    python bench/kept_blocks.py --inputs /tmp/cap --json bench/results/gradient_filtering/kept_blocks.json

A GPU multiplies tiles, not entries: a tensor-core product pays for a tile of
R rows x C vocabulary entries of d loss/d logits whole, or skips it. For
each threshold the spec's rule (docs/LOSS_SPEC.md "Gradient filtering") picks
each row's kept entries (p_v > eps * max(1 - p_token, max p), the token, and
the whole row past V/8; d = g (onehot - p) for any g != 0, so the set does
not depend on the loss's g), and this prints:

  kept            the share of the entries kept (the CPU's sparse products'
                  work, per entry)
  union R         grad_hidden gathered per block of R consecutive rows: the
                  share of the vocabulary some row of the block keeps (the
                  work of a product over each block's kept columns, W's rows
                  gathered once per block)
  tiles R x C     grad_weight (or grad_hidden) per tile: the share of R x C
                  tiles holding a kept entry (the work of a block-sparse
                  tensor-core product)

Rows run in the capture's order (token after token of each completion), the
order a chunk holds them in. Float64 softmax of the bf16-rounded inputs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np


def bf16(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even to bfloat16, kept as float32."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def kept_rows(h, w, tok, eps, cap):
    """Boolean [n, V]: the rule's kept entries of each row."""
    z = (h.astype(np.float64) @ w.astype(np.float64).T)
    z -= z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    n = len(tok)
    pt = p[np.arange(n), tok]
    q = p.copy()
    q[np.arange(n), tok] = 0.0
    rowmax = np.maximum(1.0 - pt, q.max(axis=1))
    keep = q > eps * rowmax[:, None]
    keep[np.arange(n), tok] = True
    keep[keep.sum(axis=1) > cap] = True
    return keep


def block_shares(keep, rows, cols):
    n, V = keep.shape
    out = {"kept": float(keep.mean())}
    for r in rows:
        nb = n // r
        blocks = keep[: nb * r].reshape(nb, r, V).any(axis=1)  # [nb, V]
        out[f"union {r}"] = float(blocks.mean())
        for c in cols:
            vb = V // c
            t = blocks[:, : vb * c].reshape(nb, vb, c).any(axis=2)
            out[f"tiles {r}x{c}"] = float(t.mean())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--inputs", required=True, help="a capture_smollm2.py directory")
    ap.add_argument("--eps", default="1e-5,1e-4,2.44140625e-4,1e-3",
                    help="thresholds, comma-separated (2^-12 = 2.44140625e-4)")
    ap.add_argument("--rows", default="16,64,128", help="row block sizes R")
    ap.add_argument("--cols", default="1,16,64,128", help="vocabulary tile widths C")
    ap.add_argument("--batch", type=int, default=1024, help="rows per softmax block (memory)")
    ap.add_argument("--json", help="write the table here as JSON too")
    a = ap.parse_args(argv)
    d = a.inputs
    h, w, tok, mask = (np.load(os.path.join(d, f"{n}.npy")) for n in
                       ("hidden", "weight", "token_ids", "mask"))
    h = bf16(h.reshape(-1, h.shape[-1])[mask.reshape(-1)])
    tok = tok.reshape(-1)[mask.reshape(-1)]
    w = bf16(w)
    V = w.shape[0]
    rows = [int(x) for x in a.rows.split(",")]
    cols = [int(x) for x in a.cols.split(",")]
    results = []
    for eps in (float(x) for x in a.eps.split(",")):
        keep = np.concatenate([kept_rows(h[i:i + a.batch], w, tok[i:i + a.batch], eps, V // 8)
                               for i in range(0, len(tok), a.batch)])
        r = {"eps": eps, "tokens": len(tok), "V": V, **block_shares(keep, rows, cols)}
        results.append(r)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in r.items()), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"inputs": os.path.abspath(d), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
