#!/usr/bin/env python3
"""Read `fusedgrpo bench --interleave` JSON lines: each pair's A/B time ratio,
split by which impl ran first in the pair.

The tool runs step i as A then B when i is even, B then A when odd, counting
the warm-up steps (`warmup`, at least 1) before the timed ones it records in
`step_s`. If running first or second in a pair moved a step's time, the two
halves' medians would differ in the same direction for an A/A control
(baseline,baseline) as for an A/B run; they are printed side by side here.

    python3 bench/pair_order.py bench/results/session16/*.jsonl
"""
import json
import statistics
import sys


def rows(path):
    with open(path) as f:
        lines = [json.loads(line) for line in f]
    if len(lines) != 2 or "step_s" not in lines[0]:
        return None
    a, b = lines
    warm = max(int(a["config"].get("warmup", 1)), 1)
    q = [x / y for x, y in zip(a["step_s"], b["step_s"])]
    a_first = [r for t, r in enumerate(q) if (warm + t) % 2 == 0]
    b_first = [r for t, r in enumerate(q) if (warm + t) % 2 == 1]
    return a, b, q, a_first, b_first


def med(x):
    """The median, NaN for an empty half (a run of one pair)."""
    return statistics.median(x) if x else float("nan")


def main(paths):
    print("| file | A / B | pairs | A/B median [min, max] | p50 ratio | A first: median (n) | B first: median (n) |")
    print("| --- | --- | ---: | --- | ---: | --- | --- |")
    for path in paths:
        got = rows(path)
        if got is None:
            print(f"| {path.rsplit('/', 1)[-1]} | (not one interleaved pair with step_s) | | | | | |")
            continue
        a, b, q, af, bf = got
        print(f"| {path.rsplit('/', 1)[-1]} | {a['impl']} / {b['impl']} | {len(q)} "
              f"| {med(q):.3f} [{min(q):.3f}, {max(q):.3f}] | {a['step_s_p50'] / b['step_s_p50']:.3f} "
              f"| {med(af):.3f} ({len(af)}) | {med(bf):.3f} ({len(bf)}) |")


if __name__ == "__main__":
    main(sys.argv[1:])
