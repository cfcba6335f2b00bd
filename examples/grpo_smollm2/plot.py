#!/usr/bin/env python3
"""Reward, KL and step time vs step for every arm found in a results folder
(bench/results/train_ab/<arm>.jsonl, written by train.py), as one PNG.

    python examples/grpo_smollm2/plot.py [--dir bench/results/train_ab] [--out train_ab.png]
"""
import argparse
import glob
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=os.path.join("bench", "results", "train_ab"))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    files = sorted(f for f in glob.glob(os.path.join(a.dir, "*.jsonl")) if "_smoke" not in f)
    if not files:
        raise SystemExit(f"no <arm>.jsonl in {a.dir}")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for f in files:
        arm = os.path.basename(f)[:-len(".jsonl")]
        rows = [json.loads(line) for line in open(f)]
        for ax, key in zip(axes, ("reward", "kl", "step_s")):
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=arm, lw=1)
    for ax, title in zip(axes, ("reward (generation steps)", "KL to the reference", "step time (s)")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    out = a.out or os.path.join(a.dir, "train_ab.png")
    fig.savefig(out, dpi=120)
    print(out)


if __name__ == "__main__":
    main()
