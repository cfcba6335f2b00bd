#!/usr/bin/env python3
"""The tool's JSON and SVG outputs parse (standard library only).

gradcheck --json must be one JSON object with the documented keys; bench
--json must be JSON lines, one per impl and sweep point; bench --plot must be
well-formed SVG with one polyline per impl in each of its two panels.
"""
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

fg, config, work = sys.argv[1], sys.argv[2], sys.argv[3]
os.makedirs(work, exist_ok=True)
gj, bj, svg = (os.path.join(work, n) for n in ("gradcheck.json", "bench.jsonl", "bench.svg"))


def run(*args):
    r = subprocess.run([fg, *args], capture_output=True, text=True)
    print(r.stdout, r.stderr)
    if r.returncode != 0:
        sys.exit(f"{args[0]} exited with {r.returncode}")


run("gradcheck", "--config", config, "--set", "impl=logits", "--json", gj)
g = json.load(open(gj))
for key in ("loss_ref", "loss_kernel", "abs_diff_loss", "logp_max_abs", "max_abs_diff_dlogits",
            "max_rel_diff_dlogits", "gates", "pass", "config"):
    assert key in g, key
assert g["pass"] is True and g["impl"] == "logits" and g["config"]["impl"] == "logits"
assert all(gate["pass"] for gate in g["gates"])

run("bench", "--config", config, "--set", "steps=2", "--sweep", "seq_len=4,9",
    "--impls", "fused,baseline", "--json", bj, "--plot", svg)
lines = [json.loads(line) for line in open(bj)]
assert [(d["impl"], d["seq_len"]) for d in lines] == [
    ("fused", 4), ("baseline", 4), ("fused", 9), ("baseline", 9)], lines
for d in lines:
    assert d["ok"] and d["config"]["impl"] == d["impl"]
    for key in ("cold_s", "step_s_mean", "step_s_p50", "step_s_p90", "peak_work_bytes",
                "rss_work_bytes", "gflops", "roofline_ratio", "flops_per_step"):
        assert isinstance(d[key], (int, float)), key
    assert d["step_s_p50"] > 0 and d["peak_work_bytes"] > 0
    assert d["flops_per_step"] == 6 * d["unmasked_tokens"] * d["hidden"] * d["vocab"]

root = ET.parse(svg).getroot()
polylines = root.findall("{http://www.w3.org/2000/svg}polyline")
assert len(polylines) == 4, len(polylines)  # 2 impls x 2 panels
print("json/svg outputs: OK")
