import numpy as np, fusedgrpo as fg, time
r = np.random.default_rng(0)
B, T, H, V = 1, 256, 4096, 151936
h = r.standard_normal((B, T, H), dtype=np.float32)
w = (r.standard_normal((V, H), dtype=np.float32) / np.sqrt(H)).astype(np.float32)
h, w = (fg.bf16_bits_to_f32(fg.f32_to_bf16_bits(x)) for x in (h, w))
tok = r.integers(0, V, (B, T))
mask = np.ones((B, T), bool)
adv = np.array([0.8], np.float32)
base = fg.fused_linear_grpo(h, w, tok, mask, adv, dtype="bfloat16", loss_type="dapo")
def rel(a, b): return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b))
for eps in ("auto", 2.0 ** -12):
    out = fg.fused_linear_grpo(h, w, tok, mask, adv, dtype="bfloat16", loss_type="dapo", filter_eps=eps)
    st = fg.memory_stats()
    print(eps, "kept", st["dlogits_kept"] / st["dlogits_entries"],
          "grad_hidden rel", rel(out.grad_hidden, base.grad_hidden),
          "grad_weight rel", rel(out.grad_weight, base.grad_weight))
