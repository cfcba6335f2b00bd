"""One library build through the NumPy front end: the scaled shape (B=1,
T=2048, H=2048, V=151936), 1 warm-up + 5 timed fused steps, as a JSON line
(p50, min, max, loss). Two builds are compared by running this alternately
with each build's package and library, e.g.:

  for dt in bfloat16 bfloat16 float32; do for side in /tmp/before /work/main; do
    PYTHONPATH=$side/python FUSEDGRPO_LIBRARY=$side/build/libfusedgrpo.so.0 \\
      OMP_NUM_THREADS=2 python3 bench/ab_numpy.py $dt; done; done

Unlike bench/ab_tools.sh (two tool binaries), the inputs are allocated the
same way on both sides (NumPy arrays), so only the library differs.
"""
import json
import sys
import time

import numpy as np

import fusedgrpo as fg

dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
B, T, H, V = 1, 2048, 2048, 151936
rng = np.random.default_rng(1)
hidden = rng.standard_normal((B, T, H), dtype=np.float32) * 0.5
weight = rng.standard_normal((V, H), dtype=np.float32) * 0.02
if dtype == "bfloat16":
    hidden, weight = fg.f32_to_bf16_bits(hidden), fg.f32_to_bf16_bits(weight)
tokens = rng.integers(0, V, (B, T))
mask = np.ones((B, T), bool)
advantages = rng.standard_normal(B).astype(np.float32)
old_logp = np.full((B, T), -12.0, np.float32)
times = []
for _ in range(6):
    t0 = time.perf_counter()
    r = fg.fused_linear_grpo(hidden, weight, tokens, mask, advantages, old_logp, dtype=dtype)
    times.append(time.perf_counter() - t0)
warm = sorted(times[1:])
print(json.dumps({"dtype": dtype, "p50": warm[2], "min": warm[0], "max": warm[-1],
                  "loss": float(r.loss)}))
