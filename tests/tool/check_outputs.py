#!/usr/bin/env python3
"""The tool's JSON outputs parse, and bench/plot_bench.py draws them.

gradcheck --json must be one JSON object with the documented keys; bench
--json must be JSON lines, one per impl and sweep point, with the timing,
memory and roofline keys; plot_bench.py must turn them into a PNG (that part
is skipped, with a message, when matplotlib is not installed).
"""
import importlib.util
import json
import os
import subprocess
import sys

fg, config, work, plot = sys.argv[1:5]
os.makedirs(work, exist_ok=True)
gj, bj, png = (os.path.join(work, n) for n in ("gradcheck.json", "bench.jsonl", "bench.png"))


def run(*cmd):
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    print(r.stdout, r.stderr)
    if r.returncode != 0:
        sys.exit(f"{cmd[:2]} exited with {r.returncode}")
    return r.stdout


run(fg, "gradcheck", "--config", config, "--set", "impl=logits", "--json", gj)
g = json.load(open(gj))
for key in ("loss_ref", "loss_kernel", "abs_diff_loss", "logp_max_abs", "max_abs_diff_dlogits",
            "max_rel_diff_dlogits", "gates", "pass", "config"):
    assert key in g, key
assert g["pass"] is True and g["impl"] == "logits" and g["config"]["impl"] == "logits"
assert g["config"]["loss_type"] == "dapo" and g["config"]["memory_budget"] == "min"
assert all(gate["pass"] for gate in g["gates"])

run(fg, "bench", "--config", config, "--set", "steps=2", "--sweep", "seq_len=4,9",
    "--impls", "fused,baseline", "--json", bj)
lines = [json.loads(line) for line in open(bj)]
assert [(d["impl"], d["seq_len"]) for d in lines] == [
    ("fused", 4), ("baseline", 4), ("fused", 9), ("baseline", 9)], lines
for d in lines:
    assert d["ok"] and d["config"]["impl"] == d["impl"], d
    for key in ("cold_s", "step_s_mean", "step_s_p50", "step_s_p90", "peak_work_bytes",
                "rss_work_bytes", "gflops", "roofline_s", "chunked_gemm_s", "roofline_ratio",
                "flops_per_step", "fused_chunk_rows", "fused_later_chunk_rows",
                "peak_gemm_gflops", "roofline_gflops"):
        assert isinstance(d[key], (int, float)), key
    assert d["step_s_p50"] > 0 and d["peak_work_bytes"] > 0
    assert d["roofline_s"] > 0 and d["chunked_gemm_s"] > 0 and d["fused_chunk_rows"] >= 1
    # the chunked roofline cuts chunks as the planner does: the first the longest,
    # and for the fused line's own chunks, a first and later ones that just cover
    # its unmasked tokens
    first, later = d["fused_chunk_rows"], d["fused_later_chunk_rows"]
    assert 1 <= later <= first, d
    if d["impl"] == "fused":
        k, n = d["chunks"], d["unmasked_tokens"]
        assert first + (k - 1) * later >= n and (k == 1 or first + (k - 2) * later < n), d
    assert d["peak_gemm_gflops"] > 0 and d["roofline_gflops"] > 0
    assert abs(d["roofline_ratio"] - d["roofline_s"] / d["step_s_p50"]) <= 1e-9 * d["roofline_ratio"]
    assert d["flops_per_step"] == 6 * d["unmasked_tokens"] * d["hidden"] * d["vocab"]
    assert d["dlogits_kept_frac"] == 1.0  # no gradient filtering
# memory_budget: min is a one-row chunk's need rounded up to pages, so the
# fused path runs 1-row chunks, or a few more where the page rounding leaves
# room (the per-call arrays, so the slack, differ with seq_len, and a chunk's
# GEMM scratch does not grow below FG_BLOCK_LOGITS_M rows); every impl's
# chunked roofline uses the fused path's chunk rows of its own sweep point.
for f, b in ((lines[0], lines[1]), (lines[2], lines[3])):
    assert 1 <= f["chunk_rows"] <= 4 and f["chunks"] > 1 and b["chunks"] == 1, (f, b)
    assert f["fused_chunk_rows"] == b["fused_chunk_rows"] == f["chunk_rows"], (f, b)

# Gradient filtering: a threshold of 0.5 keeps a few entries of each row.
fj = os.path.join(work, "bench_filter.jsonl")
out = run(fg, "bench", "--config", config, "--set", "steps=2", "--set", "filter_eps=0.5",
          "--set", "roofline_reps=0", "--impls", "fused", "--json", fj)
d = json.loads(open(fj).read())
assert d["ok"] and 0 < d["dlogits_kept_frac"] < 0.5, d
assert "filtering kept" in out, out

# --interleave: one child runs the pair, steps taking turns; each line holds
# the median of its pair ratios, and over an odd number of pairs the two
# medians are each other's reciprocal (the same pair, the middle one).
ij = os.path.join(work, "bench_interleave.jsonl")
run(fg, "bench", "--config", config, "--set", "steps=5", "--set", "roofline_reps=1",
    "--impls", "baseline,fused", "--interleave", "--json", ij)
a, b = (json.loads(line) for line in open(ij))
assert (a["impl"], a["paired_with"], b["impl"], b["paired_with"]) == (
    "baseline", "fused", "fused", "baseline"), (a, b)
for d in (a, b):
    assert d["ok"] and d["steps"] == 5 and d["rss_work_bytes"] is None, d
    assert d["pair_ratio_min"] <= d["pair_ratio_p50"] <= d["pair_ratio_max"], d
    assert d["roofline_s"] > 0 and d["fused_chunk_rows"] == b["chunk_rows"], d
assert abs(a["pair_ratio_p50"] * b["pair_ratio_p50"] - 1) < 1e-12, (a, b)
# step_s: the timed steps in the order they ran, so step i of each is pair i
# (cJSON writes 15 significant digits where they read back within its epsilon).
q = sorted(x / y for x, y in zip(a["step_s"], b["step_s"]))
near = lambda x, y: abs(x - y) <= 1e-12 * abs(y)
assert len(q) == 5 and near(q[2], a["pair_ratio_p50"]) and near(q[0], a["pair_ratio_min"]) and near(
    q[4], a["pair_ratio_max"]), (q, a)
for d in (a, b):
    assert near(min(d["step_s"]), d["step_s_min"]) and near(max(d["step_s"]), d["step_s_max"]), d
assert a["chunks"] == 1 and b["chunks"] > 1, (a, b)

if importlib.util.find_spec("matplotlib") is None:
    print("matplotlib not available: plot_bench.py not checked")
else:
    run(sys.executable, plot, bj, "-o", png)
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n", "not a PNG"
print("json outputs and plot: OK")
