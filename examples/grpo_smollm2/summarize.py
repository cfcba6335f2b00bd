#!/usr/bin/env python3
"""The A/B table of docs/TRAINING.md from bench/results/train_ab/<arm>.jsonl,
and the A/B's acceptance checks, as markdown.

    python examples/grpo_smollm2/summarize.py [--dir bench/results/train_ab]

Per arm: steps, median step_s and head_s [min, max], the head's share of the
step (median head_s / median step_s), peak RSS, mean reward over the first and
the last 20 steps (reward is logged on generation steps only) with its
standard error. Checks: the loss of step 1 across arms (within 1e-4
relative), the last-20-step mean rewards within two standard errors of each
other, the reward rising in every arm, fusedgrpo's median head_s below both
others and its peak RSS no higher.
"""
import argparse
import glob
import json
import math
import os
import statistics as st


def load(d):
    runs = {}
    for f in sorted(glob.glob(os.path.join(d, "*.jsonl"))):
        arm = os.path.basename(f)[:-len(".jsonl")]
        if "_smoke" not in arm:
            runs[arm] = [json.loads(line) for line in open(f)]
    return runs


def window(rows, first, n=20):
    steps = [r["step"] for r in rows]
    lo, hi = (min(steps), min(steps) + n - 1) if first else (max(steps) - n + 1, max(steps))
    vals = [r["reward"] for r in rows if lo <= r["step"] <= hi and r.get("reward") is not None]
    if not vals:
        return math.nan, math.nan, 0
    se = st.stdev(vals) / math.sqrt(len(vals)) if len(vals) > 1 else math.nan
    return st.mean(vals), se, len(vals)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=os.path.join("bench", "results", "train_ab"))
    a = ap.parse_args()
    runs = load(a.dir)
    if not runs:
        raise SystemExit(f"no <arm>.jsonl in {a.dir}")
    print("| arm | steps | step_s median [min, max] | head_s median [min, max] | head share "
          "| peak RSS (MiB) | reward, first 20 steps | reward, last 20 steps |")
    print("| --- | ---: | --- | --- | ---: | ---: | --- | --- |")
    summary = {}
    for arm, rows in runs.items():
        ss = [r["step_s"] for r in rows if r.get("step_s") is not None]
        hs = [r["head_s"] for r in rows if r.get("head_s") is not None]
        rss = max(r["peak_rss_mib"] for r in rows)
        f = window(rows, True)
        la = window(rows, False)
        summary[arm] = dict(step=st.median(ss), head=st.median(hs), rss=rss, first=f, last=la,
                            loss1=next(r["loss"] for r in rows if r["step"] == 1))
        print(f"| {arm} | {len(rows)} | {st.median(ss):.2f} [{min(ss):.2f}, {max(ss):.2f}] | "
              f"{st.median(hs):.3f} [{min(hs):.3f}, {max(hs):.3f}] | "
              f"{st.median(hs) / st.median(ss):.1%} | {rss:.0f} | "
              f"{f[0]:.3f} ± {f[1]:.3f} (n={f[2]}) | {la[0]:.3f} ± {la[1]:.3f} (n={la[2]}) |")
    print()
    arms = list(summary)
    l1 = [summary[x]["loss1"] for x in arms]
    ref = l1[0]
    spread = max(abs(x - ref) for x in l1) / max(abs(ref), 1e-30)
    losses = ", ".join("%s %.9g" % (x, summary[x]["loss1"]) for x in arms)
    print(f"- step 1 loss: {losses}; "
          f"largest relative difference {spread:.2e} ({'<=' if spread <= 1e-4 else '>'} 1e-4)")
    worst = 0.0
    for i in range(len(arms)):
        for j in range(i + 1, len(arms)):
            (mi, si, _), (mj, sj, _) = summary[arms[i]]["last"], summary[arms[j]]["last"]
            z = abs(mi - mj) / math.sqrt(si ** 2 + sj ** 2) if si > 0 or sj > 0 else 0.0
            worst = max(worst, z)
    print(f"- last-20-step mean rewards: largest difference {worst:.2f} combined standard errors "
          f"({'within' if worst <= 2 else 'beyond'} 2)")
    for x in arms:
        (f0, _, _), (l0, _, _) = summary[x]["first"], summary[x]["last"]
        print(f"- {x}: reward {f0:.3f} -> {l0:.3f} ({'rises' if l0 > f0 else 'does not rise'})")
    if "fusedgrpo" in summary:
        fz = summary["fusedgrpo"]
        others = [x for x in arms if x != "fusedgrpo"]
        print(f"- fusedgrpo head_s {fz['head']:.3f} s vs "
              + ", ".join(f"{x} {summary[x]['head']:.3f} s ({summary[x]['head'] / fz['head']:.1f}x)"
                          for x in others)
              + f"; peak RSS {fz['rss']:.0f} MiB vs "
              + ", ".join(f"{x} {summary[x]['rss']:.0f} MiB" for x in others))


if __name__ == "__main__":
    main()
