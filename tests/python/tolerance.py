"""Named tolerances, and the worst error the suite measures against each.

Every inexact comparison of tests/python goes through ``assert_close(name, got,
want)``. Its error is normwise and relative: max|got - want| / max|want| over
the whole array, so one number per comparison, independent of how many
elements are near zero. A loss is a sum whose terms may nearly cancel: its
error is relative to ``scale``, the reference's loss of the terms' magnitudes
(grpo_reference.py's loss_scale). The worst error per name is recorded;
conftest.py prints, at the end of the session, each name's tolerance, the
worst error measured and their ratio, which must stay under 10 (a tolerance
far above what the code achieves would let real bugs through). Comparisons
that must be exact use assert_array_equal instead.

Tolerances are 4-6x the worst error measured over the full suite (the
numbers in the comments). The NumPy tests also run under `qemu-x86_64 -cpu
Haswell` (scripts/wheel_test.sh), where oneDNN and the library's row kernels
take their AVX2 paths and round differently; names those tests use were
measured there too, and their tolerances cover both.
"""
from __future__ import annotations

import numpy as np

# name: tolerance on the normwise relative error. Comments: the worst error
# measured over the full suite natively (AMD EPYC, oneDNN on AVX-512 with
# bf16) and, for names the NumPy tests use, under qemu -cpu Haswell (AVX2).
TOLERANCES = {
    # The C library (float32 inside) against the float64 reference of
    # LOSS_SPEC.md (grpo_reference.py), float32 inputs; NumPy, torch and JAX.
    "f32/loss": 5e-6,                 # 1.13e-6 (vespo, whose gamma weight amplifies
                                      # a sequence's log-prob error); Haswell 3.84e-7 before vespo
    "f32/logp": 1e-6,                 # 1.81e-7; Haswell 1.48e-7
    "f32/entropy": 4e-6,              # 8.18e-7; Haswell 8.18e-7
    "f32/metric_kl": 2e-5,            # 4.81e-6; Haswell 2.81e-6 (exp(d) - d - 1 cancels)
    "f32/metric_entropy": 2e-6,       # 3.63e-7; Haswell 3.63e-7
    "f32/metric_vespo_phi": 1e-5,     # 2.17e-6
    "f32/policy_loss": 5e-6,          # 1.13e-6 (as f32/loss)
    "f32/grad_hidden": 8e-6,          # 1.65e-6; Haswell 1.43e-6
    "f32/grad_weight": 8e-6,          # 1.38e-6; Haswell 1.38e-6
    "f32/grad_bias": 6e-6,            # 1.21e-6; Haswell 1.21e-6
    # The same with bfloat16 inputs (the reference sees the rounded inputs).
    # The gradients depend on what the GEMMs multiply (the plan's gemm_dtype):
    # on a CPU with native bf16 GEMMs the library rounds dlogits to bf16 for
    # the backward GEMMs (bf16/grad_*: ~2e-3); elsewhere (AVX2) the backward
    # runs in float32 (bf16_f32gemm/grad_*). assert_close picks the name.
    "bf16/loss": 1e-5,                # 2.05e-6 (vespo); Haswell 1.79e-7 before vespo
    "bf16/logp": 4e-7,                # 8.25e-8; Haswell 8.25e-8
    "bf16/entropy": 6e-7,             # 1.19e-7; Haswell 1.19e-7
    "bf16/metric_kl": 1e-5,           # 2.36e-6 (V = 1013, off-policy mask); Haswell 8.26e-7 at V = 31
    "bf16/metric_entropy": 3e-7,      # 6.26e-8 (V = 1013); Haswell 9.18e-9 at V = 31
    "bf16/metric_vespo_phi": 4e-6,    # 8.46e-7
    "bf16/policy_loss": 1e-5,         # 2.05e-6 (as bf16/loss)
    "bf16/grad_hidden": 1e-2,         # 1.73e-3
    "bf16/grad_weight": 1.5e-2,       # 2.77e-3
    "bf16/grad_bias": 1e-2,           # 2.17e-3
    "bf16_f32gemm/grad_hidden": 4e-6,  # Haswell 6.56e-7
    "bf16_f32gemm/grad_weight": 3e-6,  # Haswell 4.81e-7
    "bf16_f32gemm/grad_bias": 3e-6,    # Haswell 5.32e-7
    # ... and gradients handed back in bfloat16 (torch / JAX, bf16 inputs).
    "bf16_out/grad_hidden": 2e-2,     # 3.56e-3
    "bf16_out/grad_weight": 2e-2,     # 3.12e-3
    # The NumPy API's bf16 gradient outputs: error (relative L2 against the
    # reference) over that of the same call's float32 gradient rounded to bf16.
    # 2 is the bound the bf16 outputs are held to, not a measurement: one rounding of
    # float32 sums gives ~1 (1.000 on AVX2).
    "bf16_out/ratio_to_rounded_f32": 2.0,
    # fg_logits_grpo (no GEMM) against the reference. Its row kernels
    # (AVX-512 or AVX2) sum in different orders: both measurements bind.
    "logits/loss": 8e-7,              # 9.23e-8; Haswell 4.24e-7
    "logits/logp": 2.5e-7,            # 2.82e-8; Haswell 1.07e-7
    "logits/entropy": 8e-7,           # 1.42e-7; Haswell 1.37e-7
    "logits/grad_logits": 2e-6,       # 4.63e-7; Haswell 4.12e-7
    # Vocab-sharded under shard_map (the phase API, lax.pmax/psum between the
    # calls; the exact merge of LOSS_SPEC "Vocab shards"). Measured on AVX2.
    "vocab_sharded/loss": 5e-7,       # 1.09e-7 (the phase path; the old hook: 3.03e-7)
    "vocab_sharded/logp": 4e-7,       # 6.89e-8
    "vocab_sharded/entropy": 1.5e-6,  # 2.93e-7
    "vocab_sharded/metric_kl": 2e-6,  # 3.82e-7
    "vocab_sharded/metric_entropy": 2e-7,  # 4.55e-8 (the hook: 1.02e-7)
    "vocab_sharded/policy_loss": 2e-7,     # 4.48e-8
    "vocab_sharded/grad_hidden": 4e-6,     # 8.11e-7
    "vocab_sharded/grad_weight": 4e-6,     # 8.48e-7
    "vocab_sharded/grad_bias": 5e-6,       # 1.05e-6
    # The library against itself with a small budget (several chunks): the
    # GEMMs run in other blocks, grad_weight is summed in another order.
    "chunking/grad_weight": 1.5e-6,   # 2.82e-7; Haswell 1.69e-7
    "chunking/logp": 5e-7,            # 8.30e-8 (AVX2: the same bits, checked exactly)
    # Batch-sharded under shard_map against the single-device call (partial
    # losses and gradients psum-ed).
    "batch_sharded/loss": 2.5e-7,     # 4.85e-8
    "batch_sharded/grad_hidden": 8e-7,  # 1.52e-7
    "batch_sharded/grad_weight": 1.5e-6,  # 3.29e-7
    "batch_sharded/grad_bias": 1.2e-6,  # 2.41e-7
    # Against other float32 implementations: Liger-Kernel (torch), and the
    # pure-JAX baseline with materialized logits (jax.nn.log_softmax).
    "liger/loss": 3e-6,               # 8.5e-7 (vespo); AVX2 3.04e-7
    "liger/metric_kl": 5e-6,          # 1.04e-6
    "liger/grad_hidden": 8e-6,        # 1.83e-6
    "liger/grad_weight": 8e-6,        # 1.71e-6
    "liger/grad_bias": 1e-5,          # 2.15e-6
    "jax_f32/loss": 2e-6,             # 4.10e-7
    "jax_f32/grad_hidden": 5e-6,      # 1.00e-6
    "jax_f32/grad_weight": 5e-6,      # 9.55e-7
    "jax_f32/grad_bias": 5e-6,        # 9.08e-7
    # Central differences (float64) against analytic gradients: of the
    # reference's own loss, of a plain-torch float64 loss, and of the library
    # through torch.autograd (float32 inside: its differences carry float32
    # round-off over the step, 1e-3).
    "fd/reference": 2e-9,             # 3.26e-10; Haswell 3.26e-10
    "fd/torch_float64": 2e-9,         # 3.67e-10
    "fd/library_float32": 1e-3,       # 2.45e-4
    # The library against the plain-torch float64 loss and its gradients.
    "torch_float64/loss": 5e-7,       # 8.29e-8
    "torch_float64/grad": 5e-7,       # 1.07e-7
}

_worst: dict = {}


def relative_error(got, want, scale=None) -> float:
    """max|got - want| over scale (default max|want|)."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"shapes differ: got {got.shape}, want {want.shape}")
    diff = float(np.max(np.abs(got - want))) if got.size else 0.0
    if scale is None:
        scale = float(np.max(np.abs(want))) if want.size else 0.0
    if diff == 0.0:
        return 0.0
    return diff / scale if scale > 0 else float("inf")


_bf16_gemm_native = None


def bf16_gemms_native() -> bool:
    """Whether this CPU's GEMMs multiply bf16 natively (dlogits rounded to
    bf16), as the library's planner reports it (gemm_dtype)."""
    global _bf16_gemm_native
    if _bf16_gemm_native is None:
        import fusedgrpo as fg
        plan = fg.fused_linear_grpo_plan(np.zeros((1, 1, 8), np.float32), np.zeros((4, 8), np.float32),
                                         np.zeros((1, 1), np.int64), np.ones((1, 1), bool),
                                         np.zeros(1, np.float32), dtype="bfloat16")
        _bf16_gemm_native = plan["gemm_dtype"] == 1
    return _bf16_gemm_native


def assert_close(name: str, got, want, context: str = "", scale=None):
    """Fails when the normwise relative error of got against want exceeds the
    named tolerance; records the error either way."""
    if name.startswith("bf16/grad_") and not bf16_gemms_native():
        name = "bf16_f32gemm/" + name.split("/", 1)[1]
    tol = TOLERANCES[name]
    err = relative_error(as_float64(got), as_float64(want), scale)
    n, worst = _worst.get(name, (0, 0.0))
    _worst[name] = (n + 1, max(worst, err))
    assert err <= tol, (f"{name}{' (' + context + ')' if context else ''}: relative error "
                        f"{err:.3g} > tolerance {tol:.3g}")


def assert_same_fraction(got, want, what: str = ""):
    """A counted fraction (a clip ratio: tokens / tokens): the same count,
    compared at float32 precision since the front ends return float32."""
    assert np.float32(got) == np.float32(want), f"{what}: {got} != {want}"


CLIP_METRICS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_region", "cispo_clip_ratio")


def as_float64(x):
    """A NumPy float64 array of x (a NumPy / JAX array, a torch tensor of any
    float dtype, a number)."""
    if hasattr(x, "detach"):  # torch: through float64, which NumPy has (bf16 it has not)
        import torch
        x = x.detach().to(torch.float64).numpy()
    return np.asarray(x, np.float64)


def compare_to_reference(prefix: str, got: dict, want: dict, context: str = ""):
    """The outputs in ``got`` (any of loss, logp, entropy, metrics, grad_hidden,
    grad_weight, grad_bias) against grpo_reference.reference's, under the
    tolerances named prefix/...; the clip ratios, fractions of counted tokens,
    exactly. A gradient the reference has none of (no bias) must be None."""
    if "loss" in got:
        loss = as_float64(got["loss"])
        assert np.isfinite(loss), context
        assert_close(f"{prefix}/loss", loss, want["loss"], context, scale=want["loss_scale"])
    for k in ("logp", "entropy"):
        if k in got:
            assert_close(f"{prefix}/{k}", as_float64(got[k]), want[k], context)
    if "metrics" in got:
        metrics = {k: as_float64(v) for k, v in got["metrics"].items()}
        for k in ("kl", "entropy"):
            assert_close(f"{prefix}/metric_{k}", metrics[k], want["metrics"][k], context)
        for k in CLIP_METRICS:
            assert_same_fraction(metrics[k], want["metrics"][k], f"{context} {k}")
        # TRL 1.16's further metrics, where the front end reports them
        for k in ("clip_ratio_low_min", "clip_ratio_high_max"):
            if k in metrics:
                if np.isnan(want["metrics"][k]):
                    assert np.isnan(metrics[k]), f"{context} {k}: {metrics[k]} != nan"
                else:
                    assert_same_fraction(metrics[k], want["metrics"][k], f"{context} {k}")
        if "vespo_phi_seq_mean" in metrics:
            if want["metrics"]["vespo_phi_seq_mean"] == 0:  # not vespo: exactly 0
                assert metrics["vespo_phi_seq_mean"] == 0, context
            else:
                assert_close(f"{prefix}/metric_vespo_phi", metrics["vespo_phi_seq_mean"],
                             want["metrics"]["vespo_phi_seq_mean"], context)
        if "policy_loss" in metrics:
            assert_close(f"{prefix}/policy_loss", metrics["policy_loss"],
                         want["metrics"]["policy_loss"], context, scale=want["loss_scale"])
    for k in ("grad_hidden", "grad_weight", "grad_bias"):
        if k not in got:
            continue
        if want[k] is None:
            assert got[k] is None, f"{context}: {k} without a bias"
        else:
            assert_close(f"{prefix}/{k}", as_float64(got[k]), want[k], context)


def summary_lines() -> list:
    """The table conftest.py prints: every tolerance with its worst measured
    error and the ratio tolerance / worst (names no test of this session
    compared show '-'; a ratio of 10 or more is flagged)."""
    rows = [("name", "tolerance", "worst", "ratio", "checks", "")]
    for name, tol in TOLERANCES.items():
        n, worst = _worst.get(name, (0, 0.0))
        if not n:
            rows.append((name, f"{tol:.3g}", "-", "-", "0", ""))
            continue
        ratio = tol / worst if worst > 0 else float("inf")
        rows.append((name, f"{tol:.3g}", f"{worst:.3g}", f"{ratio:.1f}", str(n),
                     "<- tolerance >= 10x the worst error" if ratio >= 10 else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
