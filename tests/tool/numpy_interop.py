#!/usr/bin/env python3
"""NumPy interop of the tool's .npy files (exit 77 = skipped without numpy).

1. gradcheck --save-inputs / --dump / --json on configs/tiny.yaml; NumPy
   loads every file, shapes and dtypes are as documented, and the dumped
   loss equals the JSON report's loss_kernel.
2. NumPy rewrites the inputs in other accepted dtypes (float64 hidden,
   int32 token ids, uint8 mask, a [B*T, H] hidden) with its own writer;
   gradcheck --inputs replays them and its outputs equal the first run's.
"""
import json
import os
import shutil
import subprocess
import sys

try:
    import numpy as np
except ImportError:
    print("numpy not available: skipped")
    sys.exit(77)

fg, config, work = sys.argv[1], sys.argv[2], sys.argv[3]
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
inputs, d1, d2, alt = (os.path.join(work, n) for n in ("inputs", "d1", "d2", "alt"))
report = os.path.join(work, "report.json")


def run(*args):
    r = subprocess.run([fg, "gradcheck", "--config", config, *args], capture_output=True, text=True)
    print(r.stdout, r.stderr)
    if r.returncode != 0:
        sys.exit(f"gradcheck exited with {r.returncode}")


run("--save-inputs", inputs, "--dump", d1, "--json", report)
rep = json.load(open(report))
cfg = rep["config"]
B, T, H, V = cfg["batch"], cfg["seq_len"], cfg["hidden"], cfg["vocab"]

expect_inputs = {
    "hidden": ((B, T, H), np.float32), "weight": ((V, H), np.float32),
    "bias": ((V,), np.float32), "token_ids": ((B, T), np.int64),
    "mask": ((B, T), np.bool_), "advantages": ((B,), np.float32),
    "old_logp": ((B, T), np.float32), "ref_logp": ((B, T), np.float32),
    "is_ratio": ((B, T), np.float32),
}
expect_outputs = {
    "loss": ((), np.float64), "metrics": ((6,), np.float64),
    "logp": ((B, T), np.float32), "entropy": ((B, T), np.float32),
    "grad_hidden": ((B, T, H), np.float32), "grad_weight": ((V, H), np.float32),
    "grad_bias": ((V,), np.float32),
}
arrays = {}
for d, expect in ((inputs, expect_inputs), (d1, expect_outputs)):
    for name, (shape, dtype) in expect.items():
        a = np.load(os.path.join(d, name + ".npy"))
        assert a.shape == shape, (name, a.shape, shape)
        assert a.dtype == dtype, (name, a.dtype, dtype)
        assert a.flags.c_contiguous
        arrays[name] = a

assert float(arrays["loss"]) == rep["loss_kernel"], (float(arrays["loss"]), rep["loss_kernel"])
mask = arrays["mask"]
assert np.all(arrays["logp"][~mask] == 0) and np.all(arrays["logp"][mask] <= 0)
assert np.all(arrays["token_ids"][mask] >= 0) and np.all(arrays["token_ids"][mask] < V)
assert np.all(arrays["grad_hidden"][~mask] == 0)

# NumPy-written inputs in the other accepted dtypes replay to the same outputs.
os.makedirs(alt)
np.save(os.path.join(alt, "hidden.npy"), arrays["hidden"].astype(np.float64).reshape(B * T, H))
np.save(os.path.join(alt, "weight.npy"), arrays["weight"].astype(np.float64))
np.save(os.path.join(alt, "bias.npy"), arrays["bias"])
np.save(os.path.join(alt, "token_ids.npy"), np.where(mask, arrays["token_ids"], 0).astype(np.int32))
np.save(os.path.join(alt, "mask.npy"), mask.astype(np.uint8))
for name in ("advantages", "old_logp", "ref_logp", "is_ratio"):
    np.save(os.path.join(alt, name + ".npy"), arrays[name])
run("--inputs", alt, "--dump", d2)
for name in expect_outputs:
    a = np.load(os.path.join(d1, name + ".npy"))
    b = np.load(os.path.join(d2, name + ".npy"))
    assert np.array_equal(a, b), name
print("numpy interop: OK")
