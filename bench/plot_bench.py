#!/usr/bin/env python3
"""Draw `fusedgrpo bench --json` results as a PNG.

    python3 bench/plot_bench.py sweep.jsonl [more.jsonl ...] -o sweep.png

Two panels against the swept key (the JSON lines' sweep_key): the p50 step
time and the counted peak working memory (peak_work_bytes), one line per
impl. Failed runs (ok: false) are left out. Needs matplotlib (Agg backend,
no display).
"""
import argparse
import json
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 1e3, "m": 2**20, "mib": 2**20, "mb": 1e6,
         "g": 2**30, "gib": 2**30, "gb": 1e9, "t": 2**40, "tib": 2**40, "tb": 1e12}


def x_value(text, index):
    """A sweep value as a number: plain, or a byte count such as 128MiB; else its position."""
    m = re.fullmatch(r"\s*([0-9.]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if m and m.group(2).lower() in UNITS:
        return float(m.group(1)) * UNITS[m.group(2).lower()]
    return float(index)


def scale(values, steps):
    """The largest unit of `steps` ((factor, name), descending) that the biggest value reaches."""
    top = max(values, default=0)
    for factor, name in steps:
        if top >= factor:
            return factor, name
    return steps[-1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl", nargs="+", help="bench --json output(s)")
    ap.add_argument("-o", "--out", help="PNG path (default: the first input with .png)")
    args = ap.parse_args()
    rows = [json.loads(line) for path in args.jsonl for line in open(path) if line.strip()]
    rows = [r for r in rows if r.get("command") == "bench"]
    if not rows:
        sys.exit("plot_bench: no bench results in " + ", ".join(args.jsonl))
    key = rows[0]["sweep_key"]
    order = list(dict.fromkeys(r["sweep_value"] for r in rows))
    series = {}  # impl -> [(x, p50, peak)]
    for r in rows:
        if r.get("ok"):
            x = x_value(r["sweep_value"], order.index(r["sweep_value"]))
            series.setdefault(r["impl"], []).append((x, r["step_s_p50"], r["peak_work_bytes"]))
    tf, tunit = scale([p[1] for s in series.values() for p in s], [(1, "s"), (1e-3, "ms"), (1e-6, "us")])
    mf, munit = scale([p[2] for s in series.values() for p in s],
                      [(2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B")])
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for impl, pts in series.items():
        pts.sort()
        xs = [p[0] for p in pts]
        ax_t.plot(xs, [p[1] / tf for p in pts], marker="o", label=impl)
        ax_m.plot(xs, [p[2] / mf for p in pts], marker="o", label=impl)
    for ax, title, unit in ((ax_t, "step time (p50)", tunit + " per step"),
                            (ax_m, "peak working memory (counted)", munit)):
        ax.set_title(title)
        ax.set_xlabel(key)
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
    c = rows[0].get("config", {})
    fig.suptitle(f"fusedgrpo bench: B={rows[0]['batch']} H={rows[0]['hidden']} V={rows[0]['vocab']} "
                 f"{rows[0]['dtype']} {c.get('loss_type', '')}")
    fig.tight_layout()
    out = args.out or re.sub(r"\.jsonl?$", "", args.jsonl[0]) + ".png"
    fig.savefig(out, dpi=120)
    print(out)


if __name__ == "__main__":
    main()
