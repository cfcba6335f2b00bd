#!/usr/bin/env python3
"""Peers side by side: one GRPO training step (forward + backward through the LM
head) on the same inputs, each peer in its own subprocess.

On the CPU (--device cpu, the default):

  torch_eager      PyTorch eager, materialized [N, V] logits (TRL-style formulas)
  liger            Liger-Kernel's LigerFusedLinearGRPOLoss (its pure-torch chunked path)
  trl_chunked      TRL 1.16's own fused LM head (trl.kernels.ChunkedLogProbFunction, what
                   GRPOTrainer uses: log-probs and entropy in [4096, chunk] tiles, torch ops
                   without Triton), then TRL's loss on the log-probs
  jax_pure         jitted pure JAX, materialized logits (jax.nn.log_softmax)
  fusedgrpo_numpy  fusedgrpo.fused_linear_grpo (NumPy front end)
  fusedgrpo_torch  fusedgrpo.torch.FusedLinearGRPOLoss (custom op)
  fusedgrpo_jax    fusedgrpo.jax.fused_linear_grpo_loss (XLA FFI custom call), jitted

Every child regenerates the same inputs from --seed (so no big file is passed
around), runs --warmup untimed steps, then --reps timed steps, and reports the
median step time. "peak RSS" is the child's VmHWM over its timed steps,
restarted after the warm-up (/proc/self/clear_refs): the steady state of a
training loop, without set-up transients (a framework's copy of the inputs) or
the first step's one-time costs (jit compilation); "process peak" is its
ru_maxrss (os.wait4), everything included. For the fusedgrpo peers, "outside C" is the step's time
outside the C library's call over the call's own time (fg_memory_stats'
call_seconds; fusedgrpo.jax.call_totals() for the FFI handler): the cost of the
front end, measured in the same step so the machine's drift cancels. "setup
RSS" is the child's RSS after imports and inputs, before its first step.
Prints a markdown table on stdout.

On a CUDA device (--device cuda; CUDA_PEERS below, the section
"CUDA"): the bare products (gemm_floor), fusedgrpo's torch module on CUDA
tensors (the library's CUDA backend) at its default budget and a wide one,
TRL 1.16's chunked log-prob function with TRL's loss, Liger-Kernel compiled
and not, Apple's Cut Cross-Entropy with its filter off and "auto", PyTorch
eager and pure JAX with materialized logits. The inputs are made on the device
from a counter hash of --seed (the same numbers in torch and JAX); each step is
timed between two synchronizations; the memory is the device's peak above the
inputs over the timed steps; every step time is also a ratio to gemm_floor's,
measured in its own child in the same run. A peer that cannot run (import
error, out of memory, compile failure, time limit) is a row with its error.

  python bench/peers/run_peers.py                       # small default shape
  python bench/peers/run_peers.py --seq-len 2048 --hidden 2048 --vocab 151936 --dtype bfloat16
  python bench/peers/run_peers.py --device cuda --seq-len 8192,32768 --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PEERS = ["torch_eager", "liger", "trl_chunked", "jax_pure", "fusedgrpo_numpy", "fusedgrpo_torch",
         "fusedgrpo_jax"]


# ------------------------------------------------------------------ inputs

def make_inputs(a):
    import numpy as np
    rng = np.random.default_rng(a.seed)
    B, T, H, V = a.batch, a.seq_len, a.hidden, a.vocab
    hidden = rng.standard_normal((B, T, H), dtype=np.float32)
    weight = rng.standard_normal((V, H), dtype=np.float32)
    weight *= np.float32(1.0 / np.sqrt(H))
    tok = rng.integers(0, V, (B, T), dtype=np.int64)
    mask = np.ones((B, T), dtype=bool)
    for b in range(B):
        mask[b, int(T * (0.75 + 0.25 * rng.random())):] = False
    adv = rng.standard_normal(B).astype(np.float32)
    # plausible log-probs for the sampler and the reference policy
    old = (-rng.gamma(2.0, 1.5, (B, T))).astype(np.float32)
    ref = (old + rng.normal(0, 0.05, (B, T))).astype(np.float32)
    return dict(hidden=hidden, weight=weight, token_ids=tok, mask=mask, advantages=adv,
                old_logp=old, ref_logp=ref)


def cfg_of(a):
    return dict(loss_type=a.loss_type, beta=a.beta, epsilon_low=0.2, epsilon_high=0.28,
                temperature=a.temperature)


def rss_mib(field="VmRSS"):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def reset_peak_rss():
    """Restart VmHWM at the current RSS (Linux clear_refs 5), so the step peak
    leaves out set-up transients such as a framework's copy of the inputs.
    This also restarts the ru_maxrss that os.wait4 reports."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------ peers (children)

def torch_grpo_loss(torch, logp, old, ref, mask, adv, c):
    """TRL's per-token GRPO loss (token level), dapo/bnpo/grpo aggregation."""
    ratio = torch.exp(logp - old)
    A = adv[:, None]
    L = -torch.min(ratio * A, torch.clamp(ratio, 1 - c["epsilon_low"], 1 + c["epsilon_high"]) * A)
    if c["beta"] != 0:
        d = ref - logp
        L = L + c["beta"] * (torch.exp(d) - d - 1)
    m = mask.to(L.dtype)
    if c["loss_type"] == "grpo":
        return ((L * m).sum(1) / m.sum(1).clamp(min=1)).mean()
    return (L * m).sum() / m.sum().clamp(min=1)


def peer_torch(a, inp, kind):
    import torch
    if a.threads:
        torch.set_num_threads(a.threads)
    dt = torch.bfloat16 if a.dtype == "bfloat16" else torch.float32
    h = torch.from_numpy(inp["hidden"]).to(dt).requires_grad_()
    w = torch.from_numpy(inp["weight"]).to(dt).requires_grad_()
    tok = torch.from_numpy(inp["token_ids"])
    mask = torch.from_numpy(inp["mask"])
    adv = torch.from_numpy(inp["advantages"])
    old = torch.from_numpy(inp["old_logp"])
    ref = torch.from_numpy(inp["ref_logp"])
    c = cfg_of(a)
    if kind == "torch_eager":
        def step():
            h.grad = w.grad = None
            logits = (h @ w.T).float() / c["temperature"]
            lsm = torch.log_softmax(logits, -1)
            logp = torch.gather(lsm, -1, tok[..., None])[..., 0]
            loss = torch_grpo_loss(torch, logp, old, ref, mask, adv, c)
            loss.backward()
            return loss.item()
    elif kind == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
        mod = LigerFusedLinearGRPOLoss(beta=c["beta"], epsilon_low=c["epsilon_low"],
                                       epsilon_high=c["epsilon_high"], loss_type=c["loss_type"],
                                       temperature=c["temperature"], compiled=a.liger_compiled,
                                       chunk_size=a.liger_chunk_size)

        def step():
            h.grad = w.grad = None
            loss, _ = mod(h, w, tok, mask.long(), adv, ref_per_token_logps=ref,
                          old_per_token_logps=old)
            loss.backward()
            return loss.item()
    elif kind == "trl_chunked":
        from trl.kernels import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE
        flat_h = h.reshape(-1, h.shape[-1])

        def step():
            h.grad = w.grad = None
            # As GRPOTrainer's fused head on a device without Triton: every position scored.
            logp, _entropy, *_ = ChunkedLogProbFunction.apply(
                flat_h, w, None, tok.reshape(-1), c["temperature"], _CHUNKED_LOGPROB_CHUNK_SIZE, None,
                1.0, ("log_probs", "entropy"))
            loss = torch_grpo_loss(torch, logp.view(tok.shape).float(), old, ref, mask, adv, c)
            loss.backward()
            return loss.item()
    else:
        from fusedgrpo.torch import FusedLinearGRPOLoss
        mod = FusedLinearGRPOLoss(beta=c["beta"], epsilon_low=c["epsilon_low"],
                                  epsilon_high=c["epsilon_high"], loss_type=c["loss_type"],
                                  temperature=c["temperature"], threads=a.threads,
                                  memory_budget=a.memory_budget)

        def step():
            h.grad = w.grad = None
            loss, _ = mod(h, w, tok, mask, adv, ref_per_token_logps=ref,
                          old_per_token_logps=old)
            loss.backward()
            return loss.item()
        step.c_seconds = lambda: _fg_call_seconds(a)
    return step


def peer_jax(a, inp, kind):
    import jax
    import jax.numpy as jnp
    dt = jnp.bfloat16 if a.dtype == "bfloat16" else jnp.float32
    h = jnp.asarray(inp["hidden"], dt)
    w = jnp.asarray(inp["weight"], dt)
    tok = jnp.asarray(inp["token_ids"], jnp.int32)
    mask = jnp.asarray(inp["mask"])
    adv = jnp.asarray(inp["advantages"])
    old = jnp.asarray(inp["old_logp"])
    ref = jnp.asarray(inp["ref_logp"])
    c = cfg_of(a)
    if kind == "jax_pure":
        def loss_fn(h, w):
            logits = jnp.dot(h, w.T, preferred_element_type=jnp.float32) / c["temperature"]
            lsm = jax.nn.log_softmax(logits, -1)
            logp = jnp.take_along_axis(lsm, tok[..., None], -1)[..., 0]
            ratio = jnp.exp(logp - old)
            A = adv[:, None]
            L = -jnp.minimum(ratio * A, jnp.clip(ratio, 1 - c["epsilon_low"],
                                                 1 + c["epsilon_high"]) * A)
            if c["beta"] != 0:
                d = ref - logp
                L = L + c["beta"] * (jnp.exp(d) - d - 1)
            m = mask.astype(jnp.float32)
            if c["loss_type"] == "grpo":
                return ((L * m).sum(1) / jnp.maximum(m.sum(1), 1)).mean()
            return (L * m).sum() / jnp.maximum(m.sum(), 1)
    else:
        import fusedgrpo.jax as fgj
        fgj.backend()  # the FFI handler (built with the package) is loaded at import

        def loss_fn(h, w):
            return fgj.fused_linear_grpo_loss(h, w, tok, mask, adv, old, ref, threads=a.threads,
                                              memory_budget=a.memory_budget, **c)
    f = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))

    def step():
        loss, g = f(h, w)
        jax.block_until_ready(g)
        return float(loss)
    if kind == "fusedgrpo_jax":
        last = [fgj.call_totals()["call_seconds"]]

        def c_seconds():
            now = fgj.call_totals()["call_seconds"]
            dt, last[0] = now - last[0], now
            return dt
        step.c_seconds = c_seconds
    return step


def peer_numpy(a, inp):
    import fusedgrpo as fg
    h, w = inp["hidden"], inp["weight"]
    if a.dtype == "bfloat16":
        h, w = fg.f32_to_bf16_bits(h), fg.f32_to_bf16_bits(w)
    c = cfg_of(a)

    def step():
        r = fg.fused_linear_grpo(h, w, inp["token_ids"], inp["mask"], inp["advantages"],
                                 inp["old_logp"], inp["ref_logp"], threads=a.threads,
                                 memory_budget=a.memory_budget, **c)
        return r.loss
    step.c_seconds = lambda: _fg_call_seconds(a)
    return step


def _fg_call_seconds(a):
    """Seconds the last fusedgrpo call spent inside the C library (its context's
    fg_memory_stats.call_seconds): the step minus this is the front end's cost."""
    import fusedgrpo as fg
    return fg.memory_stats()["call_seconds"]


def child(a):
    if a.threads:
        for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(v, str(a.threads))
    t0 = time.perf_counter()
    try:
        inp = make_inputs(a)
        if a.child in ("torch_eager", "liger", "trl_chunked", "fusedgrpo_torch"):
            step = peer_torch(a, inp, a.child)
        elif a.child in ("jax_pure", "fusedgrpo_jax"):
            step = peer_jax(a, inp, a.child)
        else:
            step = peer_numpy(a, inp)
    except ImportError as e:
        print(json.dumps({"status": f"unavailable ({e.name or e})"}))
        return 0
    del inp  # the peers hold what they need
    import gc
    gc.collect()
    setup_s = time.perf_counter() - t0
    rss_setup = rss_mib()
    pre_reset_peak = rss_mib("VmHWM")  # clear_refs below restarts ru_maxrss too
    hwm_reset = reset_peak_rss() if a.warmup == 0 else False
    times, overheads = [], []
    c_seconds = getattr(step, "c_seconds", None)
    loss = None
    for i in range(a.warmup + a.reps):
        t = time.perf_counter()
        loss = step()
        dt = time.perf_counter() - t
        c = c_seconds() if c_seconds else None
        if i == 0:
            first = dt
        if i == a.warmup - 1:
            # steady state: the timed steps' peak, without the first step's
            # one-time costs (jit compilation, the workspace's first mapping)
            pre_reset_peak = rss_mib("VmHWM")
            hwm_reset = reset_peak_rss()
        if i >= a.warmup:
            times.append(dt)
            if c:
                # the front end's share: the step's time outside the C call,
                # over the C call's time (immune to the machine's drift)
                overheads.append((dt - c) / c)
    print(json.dumps({"status": "ok", "median_s": statistics.median(times), "min_s": min(times),
                      "first_s": first, "setup_s": setup_s, "rss_setup_mib": rss_setup,
                      "loss": loss,
                      "step_peak_rss_mib": rss_mib("VmHWM") if hwm_reset else None,
                      "pre_reset_peak_rss_mib": pre_reset_peak,
                      "front_end_overhead": statistics.median(overheads) if overheads
                      else None}))
    return 0


# ------------------------------------------------------------------ CUDA
# One child per (peer, shape). Each reports its step times (synchronized
# around every step), the device's peak memory above the inputs over the
# timed steps, its loss, the GPU's name and the first step's time (compilation,
# autotuning and first allocations included).

# In this order under the run's deadline: the filtered rows beside CCE's
# filtered one before the slow peers, which a short run may leave out.
CUDA_PEERS = ["gemm_floor", "fusedgrpo_torch", "fusedgrpo_torch_filter_auto", "cce_filter_auto",
              "fusedgrpo_torch_filter_cce_eps", "fusedgrpo_torch_wide", "trl_chunked", "cce",
              "torch_eager", "liger", "jax_pure", "liger_compiled"]

CUDA_NOTES = {
    "gemm_floor": "torch.mm x3 in bf16 at full shape (logits, grad_hidden, grad_weight), "
                  "bf16 outputs: the floor",
    "fusedgrpo_torch": "fusedgrpo.torch.FusedLinearGRPOLoss, CUDA backend, default budget",
    "fusedgrpo_torch_wide": "fusedgrpo.torch.FusedLinearGRPOLoss, CUDA backend, "
                            "memory_budget=--wide-budget",
    "fusedgrpo_torch_filter_auto": "fusedgrpo.torch.FusedLinearGRPOLoss, CUDA backend, "
                                   "default budget, filter_eps='auto' (gradient filtering)",
    "fusedgrpo_torch_filter_cce_eps": "the same with filter_eps=2**-12, the threshold of CCE's "
                                      "'auto' for bf16, in fusedgrpo's relative rule",
    "trl_chunked": "TRL 1.16 kernels/chunked_logprob.py (ChunkedLogProbFunction, Triton "
                   "folds, masked rows only as GRPOTrainer on CUDA) + TRL's loss",
    "liger": "Liger-Kernel LigerFusedLinearGRPOLoss, compiled=False",
    "liger_compiled": "Liger-Kernel LigerFusedLinearGRPOLoss, compiled=True (torch.compile)",
    "cce": "Cut Cross-Entropy linear_cross_entropy(reduction='none', filter_eps=None) "
           "+ TRL's loss",
    "cce_filter_auto": "Cut Cross-Entropy linear_cross_entropy(reduction='none', "
                       "filter_eps='auto') + TRL's loss",
    "torch_eager": "PyTorch eager, materialized float32 [N, V] logits",
    "jax_pure": "pure JAX under jax.jit, materialized float32 logits",
}

_M32 = 0xFFFFFFFF


def _lowbias32(x: int) -> int:
    """A 32-bit integer hash (lowbias32), on one Python int; the torch and
    JAX versions below compute the same on whole arrays."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _stream_key(seed: int, stream: int) -> int:
    """The offset of one input's counter stream (a hash of seed and stream)."""
    return _lowbias32(((seed & _M32) * 0x85EBCA6B ^ stream * 0x9E3779B9) & _M32)


def _uniform_py(seed, stream, i):
    return ((_lowbias32((i + _stream_key(seed, stream)) & _M32) >> 8) + 0.5) * 2.0 ** -24


# Streams of the inputs (each tensor its own counter stream).
_S_HIDDEN, _S_WEIGHT, _S_TOKENS, _S_OLD1, _S_OLD2, _S_REF, _S_ADV, _S_LEN = range(1, 9)
_SQRT3 = 3.0 ** 0.5


def _lengths_and_advantages(a, T):
    """Per-sequence completion lengths (75% to 100% of T) and advantages
    (uniform, unit variance), from the hash on the host: small, exact."""
    lens = [int(T * (0.75 + 0.25 * _uniform_py(a.seed, _S_LEN, b))) for b in range(a.batch)]
    adv = [(2.0 * _uniform_py(a.seed, _S_ADV, b) - 1.0) * _SQRT3 for b in range(a.batch)]
    return lens, adv


def _torch_hash_u32(torch, idx, key):
    """lowbias32((idx + key) mod 2^32) on an int64 tensor of values < 2^32;
    the products split in 16-bit halves so that no int64 product overflows."""
    def mul32(x, c):
        return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32
    x = (idx + key) & _M32
    x = x ^ (x >> 16)
    x = mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _torch_uniform(torch, n, seed, stream, device, out=None, scale=None):
    """n uniforms in (0, 1) float32 of one stream, or with `scale`, the
    unit-variance symmetric (2u - 1) * sqrt(3) * scale, written into `out`
    (any dtype); in slices of 2^24 so that the int64 temporaries stay small."""
    key = _stream_key(seed, stream)
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=device)
    flat = out.view(-1)
    step = 1 << 24
    for s in range(0, n, step):
        e = min(n, s + step)
        idx = torch.arange(s, e, dtype=torch.int64, device=device)
        u = ((_torch_hash_u32(torch, idx, key) >> 8).to(torch.float32) + 0.5) * 2.0 ** -24
        if scale is not None:
            u = (u * 2.0 - 1.0) * (_SQRT3 * scale)
        flat[s:e] = u.to(flat.dtype)
    return out


def cuda_inputs_torch(a, T, torch, device, dt):
    """The inputs on the device, torch tensors: hidden [B, T, H] and weight
    [V, H] (dt), token_ids [B, T] int64, mask [B, T] bool, advantages [B],
    old / ref log-probs [B, T] float32 (old = -Gamma(2, 1.5), ref = old +- 0.05)."""
    B, H, V = a.batch, a.hidden, a.vocab
    N = B * T
    hidden = torch.empty((B, T, H), dtype=dt, device=device)
    _torch_uniform(torch, N * H, a.seed, _S_HIDDEN, device, out=hidden, scale=1.0)
    weight = torch.empty((V, H), dtype=dt, device=device)
    _torch_uniform(torch, V * H, a.seed, _S_WEIGHT, device, out=weight, scale=1.0 / H ** 0.5)
    idx = torch.arange(N, dtype=torch.int64, device=device)
    tok = (_torch_hash_u32(torch, idx, _stream_key(a.seed, _S_TOKENS)) % V).view(B, T)
    u1 = _torch_uniform(torch, N, a.seed, _S_OLD1, device)
    u2 = _torch_uniform(torch, N, a.seed, _S_OLD2, device)
    old = (1.5 * (torch.log(u1) + torch.log(u2))).view(B, T)
    ref = old + _torch_uniform(torch, N, a.seed, _S_REF, device, scale=0.05).view(B, T)
    lens, adv = _lengths_and_advantages(a, T)
    mask = torch.arange(T, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
    adv = torch.tensor(adv, dtype=torch.float32, device=device)
    return hidden, weight, tok, mask, adv, old, ref


def cuda_inputs_jax(a, T, dt):
    """cuda_inputs_torch's inputs as JAX arrays on the default device, from the
    same hash in uint32 arithmetic (which wraps modulo 2^32)."""
    import jax
    import jax.numpy as jnp

    B, H, V = a.batch, a.hidden, a.vocab
    N = B * T

    def hash_u32(n, stream):
        x = jax.lax.iota(jnp.uint32, n) + jnp.uint32(_stream_key(a.seed, stream))
        x = x ^ (x >> 16)
        x = x * jnp.uint32(0x7FEB352D)
        x = x ^ (x >> 15)
        x = x * jnp.uint32(0x846CA68B)
        return x ^ (x >> 16)

    def uniform(n, stream, scale=None):
        u = ((hash_u32(n, stream) >> 8).astype(jnp.float32) + 0.5) * 2.0 ** -24
        return u if scale is None else (u * 2.0 - 1.0) * (_SQRT3 * scale)

    @jax.jit
    def make():
        hidden = uniform(N * H, _S_HIDDEN, 1.0).astype(dt).reshape(B, T, H)
        weight = uniform(V * H, _S_WEIGHT, 1.0 / H ** 0.5).astype(dt).reshape(V, H)
        tok = (hash_u32(N, _S_TOKENS) % jnp.uint32(V)).astype(jnp.int32).reshape(B, T)
        old = (1.5 * (jnp.log(uniform(N, _S_OLD1)) + jnp.log(uniform(N, _S_OLD2)))).reshape(B, T)
        ref = old + uniform(N, _S_REF, 0.05).reshape(B, T)
        return hidden, weight, tok, old, ref

    hidden, weight, tok, old, ref = make()
    lens, adv = _lengths_and_advantages(a, T)
    mask = jnp.arange(T)[None, :] < jnp.asarray(lens)[:, None]
    return hidden, weight, tok, mask, jnp.asarray(adv, jnp.float32), old, ref


def load_trl_chunked_logprob():
    """TRL's trl/kernels/chunked_logprob.py (the installed TRL's file, run as it
    is), without importing trl/__init__, trl.trainer or transformers: TRL's
    trainer utilities import transformers, accelerate, datasets (pyarrow) and
    pandas, which a GPU machine without a package registry lacks. The module
    needs three names from them, stubbed here in sys.modules:
      transformers.utils.is_triton_available  -> Triton importable (transformers
                                                 also checks Triton >= 1.0);
      trl.trainer.utils.maybe_gather_lm_head_ctx -> a null context (TRL's own
                                                 is one unless DeepSpeed ZeRO-3
                                                 is enabled);
    and the packages trl, trl.kernels, trl.trainer as empty namespaces. Returns
    (module, TRL's version, GRPOTrainer's vocabulary chunk read from
    trl/trainer/utils.py's source)."""
    import contextlib
    import importlib.metadata
    import importlib.util
    import re
    import types

    spec = importlib.util.find_spec("trl")  # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("No module named 'trl'", name="trl")
    root = list(spec.submodule_search_locations)[0]
    path = os.path.join(root, "kernels", "chunked_logprob.py")
    if not os.path.exists(path):
        raise ImportError(f"{path} not found (TRL 1.16 has it)", name="trl.kernels")
    try:
        version = importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    chunk = 32768
    try:
        with open(os.path.join(root, "trainer", "utils.py")) as f:
            m = re.search(r"^_CHUNKED_LOGPROB_CHUNK_SIZE\s*=\s*(\d+)", f.read(), re.M)
        if m:
            chunk = int(m.group(1))
    except OSError:
        pass

    def package(name, path=()):
        mod = types.ModuleType(name)
        mod.__path__ = list(path)
        sys.modules[name] = mod
        return mod

    tf = package("transformers")
    tf_utils = types.ModuleType("transformers.utils")
    tf_utils.is_triton_available = lambda *a, **k: importlib.util.find_spec("triton") is not None
    sys.modules["transformers.utils"] = tf.utils = tf_utils
    trl_pkg = package("trl", [root])
    trl_pkg.kernels = package("trl.kernels", [os.path.join(root, "kernels")])
    trl_pkg.trainer = package("trl.trainer")
    tr_utils = types.ModuleType("trl.trainer.utils")
    tr_utils.maybe_gather_lm_head_ctx = lambda *params: contextlib.nullcontext()
    sys.modules["trl.trainer.utils"] = trl_pkg.trainer.utils = tr_utils
    mspec = importlib.util.spec_from_file_location("trl.kernels.chunked_logprob", path)
    mod = importlib.util.module_from_spec(mspec)
    sys.modules["trl.kernels.chunked_logprob"] = mod
    mspec.loader.exec_module(mod)
    return mod, version, chunk


def cuda_peer_torch(a, T, kind, device):
    """(step, params, extra): step() runs one training step on `device` (a
    CUDA device; the CPU runs the same code, for checking it) and returns its
    loss (a tensor, or None for gemm_floor); params are the tensors whose
    .grad is cleared before the memory baseline; extra: the peer's own
    numbers (fusedgrpo: the context its calls use, for its memory and C time)."""
    import torch
    dt = torch.bfloat16 if a.dtype == "bfloat16" else torch.float32
    h, w, tok, mask, adv, old, ref = cuda_inputs_torch(a, T, torch, device, dt)
    c = cfg_of(a)
    extra = {}
    if kind == "gemm_floor":
        hf = h.view(-1, h.shape[-1])

        def step():
            # the three products of a step, at full shape, as torch.mm runs them
            with torch.no_grad():
                logits = torch.mm(hf, w.t())  # [N, V]
                torch.mm(logits, w)           # grad_hidden [N, H]
                torch.mm(logits.t(), hf)      # grad_weight [V, H]
            return None
        return step, [], extra
    h.requires_grad_()
    w.requires_grad_()
    if kind == "torch_eager":
        def step():
            h.grad = w.grad = None
            logits = (h @ w.T).float() / c["temperature"]
            lsm = torch.log_softmax(logits, -1)
            logp = torch.gather(lsm, -1, tok[..., None])[..., 0]
            loss = torch_grpo_loss(torch, logp, old, ref, mask, adv, c)
            loss.backward()
            return loss
    elif kind in ("liger", "liger_compiled"):
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
        mod = LigerFusedLinearGRPOLoss(beta=c["beta"], epsilon_low=c["epsilon_low"],
                                       epsilon_high=c["epsilon_high"], loss_type=c["loss_type"],
                                       temperature=c["temperature"],
                                       compiled=kind == "liger_compiled",
                                       chunk_size=a.liger_chunk_size)
        mask_long = mask.long()

        def step():
            h.grad = w.grad = None
            loss, _ = mod(h, w, tok, mask_long, adv, ref_per_token_logps=ref,
                          old_per_token_logps=old)
            loss.backward()
            return loss
    elif kind == "trl_chunked":
        clp, version, chunk = load_trl_chunked_logprob()
        extra["trl_version"] = version
        compact = clp._use_triton(device)
        extra["trl_triton"] = bool(compact)

        def step():
            h.grad = w.grad = None
            # As GRPOTrainer's fused head (trl/trainer/utils.py add_fused_lm_head):
            # on a Triton device only the masked-in rows are scored, then scattered.
            if compact:
                lp, _ent, *_ = clp.ChunkedLogProbFunction.apply(
                    h[mask], w, None, tok[mask], c["temperature"], chunk, None, 1.0,
                    ("log_probs", "entropy"))
                logp = lp.new_zeros(mask.shape).masked_scatter(mask, lp)
            else:
                lp, _ent, *_ = clp.ChunkedLogProbFunction.apply(
                    h.reshape(-1, h.shape[-1]), w, None, tok.reshape(-1), c["temperature"],
                    chunk, None, 1.0, ("log_probs", "entropy"))
                logp = lp.view(mask.shape).masked_fill(~mask, 0)
            loss = torch_grpo_loss(torch, logp.float(), old, ref, mask, adv, c)
            loss.backward()
            return loss
    elif kind in ("cce", "cce_filter_auto"):
        from cut_cross_entropy import linear_cross_entropy
        targets = tok.masked_fill(~mask, -100)  # CCE's ignore_index: masked rows skipped
        eps = "auto" if kind == "cce_filter_auto" else None

        def step():
            h.grad = w.grad = None
            e = h if c["temperature"] == 1.0 else h / c["temperature"]
            nll = linear_cross_entropy(e, w, targets, reduction="none", filter_eps=eps)
            loss = torch_grpo_loss(torch, -nll.float(), old, ref, mask, adv, c)
            loss.backward()
            return loss
    elif kind.startswith("fusedgrpo_torch"):
        from fusedgrpo import _lib
        from fusedgrpo.torch import FusedLinearGRPOLoss
        budget = a.wide_budget if kind == "fusedgrpo_torch_wide" else a.memory_budget
        mod = FusedLinearGRPOLoss(beta=c["beta"], epsilon_low=c["epsilon_low"],
                                  epsilon_high=c["epsilon_high"], loss_type=c["loss_type"],
                                  temperature=c["temperature"], memory_budget=budget,
                                  filter_eps={"fusedgrpo_torch_filter_auto": "auto",
                                              "fusedgrpo_torch_filter_cce_eps": 2.0 ** -12}
                                  .get(kind, 0.0))
        # the context the op's calls use: this thread's CUDA context on torch's
        # current stream (fusedgrpo._torch_inputs.call_context)
        ctx = (_lib.device_context("cuda", torch.cuda.current_stream(device).cuda_stream)
               if device.type == "cuda" else _lib.thread_context())
        extra["fg_context"] = ctx
        extra["memory_budget"] = budget

        def step():
            h.grad = w.grad = None
            loss, _ = mod(h, w, tok, mask, adv, ref_per_token_logps=ref,
                          old_per_token_logps=old)
            loss.backward()
            return loss
    else:
        raise ValueError(kind)
    return step, [h, w], extra


def cuda_child_torch(a, T):
    import torch
    if not torch.cuda.is_available():
        return {"status": "unavailable (no CUDA device)"}
    t0 = time.perf_counter()
    step, params, extra = cuda_peer_torch(a, T, a.child,
                                          torch.device("cuda", torch.cuda.current_device()))
    torch.cuda.synchronize()
    setup_s = time.perf_counter() - t0
    fg_ctx = extra.pop("fg_context", None)
    times, c_times, base = [], [], None
    first = loss = None

    def restart_peak():
        # the baseline: inputs (and the module) only, no gradients held
        for p in params:
            p.grad = None
        torch.cuda.synchronize()
        if fg_ctx is not None:
            fg_ctx.reset_peak_memory()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    if a.warmup == 0:
        base = restart_peak()
    for i in range(a.warmup + a.reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        dt_s = time.perf_counter() - t
        if i == 0:
            first = dt_s
        if i >= a.warmup:
            times.append(dt_s)
            if fg_ctx is not None:
                # call_seconds is the last call's: the forward's one C call
                c_times.append(fg_ctx.memory_stats()["call_seconds"])
        if i == a.warmup - 1:
            base = restart_peak()
    peak = torch.cuda.max_memory_allocated() - base
    res = {"status": "ok", "median_s": statistics.median(times), "min_s": min(times),
           "max_s": max(times), "first_s": first, "setup_s": setup_s,
           "loss": None if loss is None else float(loss.detach()), "input_mib": base / 2 ** 20,
           "torch_peak_above_inputs_mib": peak / 2 ** 20,
           "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if fg_ctx is not None:
        # The library's workspace is its own (cudaMallocAsync), outside torch's
        # allocator: its peak adds to torch's (an upper bound of the sum).
        st = fg_ctx.memory_stats()
        res["fg_peak_mib"] = st["peak_bytes"] / 2 ** 20
        res["fg_chunks"] = st["chunks"]
        res["fg_chunk_rows"] = st["chunk_rows"]
        if st.get("dlogits_entries"):
            res["fg_kept"] = st["dlogits_kept"] / st["dlogits_entries"]
        peak += st["peak_bytes"]
        res["outside_c"] = statistics.median((t - c) / c for t, c in zip(times, c_times)
                                             if c > 0) if any(c > 0 for c in c_times) else None
    res["peak_above_inputs_mib"] = peak / 2 ** 20
    res.update(extra)
    return res


def cuda_child_jax(a, T):
    # JAX's allocator takes 75% of the device at start unless told not to;
    # without preallocation its statistics show what the step uses.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import jax.numpy as jnp
    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError as e:
        return {"status": f"unavailable (JAX has no GPU: {str(e)[:200]})"}
    t0 = time.perf_counter()
    dt = jnp.bfloat16 if a.dtype == "bfloat16" else jnp.float32
    h, w, tok, mask, adv, old, ref = cuda_inputs_jax(a, T, dt)
    c = cfg_of(a)

    def loss_fn(h, w, tok, mask, adv, old, ref):
        logits = jnp.dot(h, w.T, preferred_element_type=jnp.float32) / c["temperature"]
        lsm = jax.nn.log_softmax(logits, -1)
        logp = jnp.take_along_axis(lsm, tok[..., None], -1)[..., 0]
        ratio = jnp.exp(logp - old)
        A = adv[:, None]
        L = -jnp.minimum(ratio * A, jnp.clip(ratio, 1 - c["epsilon_low"],
                                             1 + c["epsilon_high"]) * A)
        if c["beta"] != 0:
            d = ref - logp
            L = L + c["beta"] * (jnp.exp(d) - d - 1)
        m = mask.astype(jnp.float32)
        if c["loss_type"] == "grpo":
            return ((L * m).sum(1) / jnp.maximum(m.sum(1), 1)).mean()
        return (L * m).sum() / jnp.maximum(m.sum(), 1)

    args = (h, w, tok, mask, adv, old, ref)
    jax.block_until_ready(args)
    stats0 = dev.memory_stats() or {}
    base = stats0.get("bytes_in_use")
    tc = time.perf_counter()
    # compiled ahead of the first step, so the first step's time leaves it out
    compiled = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1))).lower(*args).compile()
    compile_s = time.perf_counter() - tc
    setup_s = time.perf_counter() - t0
    plan = None
    try:
        ma = compiled.memory_analysis()
        # XLA's buffer plan: what the program allocates beside its arguments
        plan = (ma.temp_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend reports one
        pass
    times, first, loss = [], None, None
    for i in range(a.warmup + a.reps):
        t = time.perf_counter()
        out = compiled(*args)
        jax.block_until_ready(out)
        dt_s = time.perf_counter() - t
        loss = out[0]
        del out  # no gradients held from one step to the next
        if i == 0:
            first = dt_s
        if i >= a.warmup:
            times.append(dt_s)
    stats = dev.memory_stats() or {}
    res = {"status": "ok", "median_s": statistics.median(times), "min_s": min(times),
           "max_s": max(times), "first_s": first, "setup_s": setup_s, "compile_s": compile_s,
           "loss": float(loss), "device": getattr(dev, "device_kind", str(dev)),
           "jax": jax.__version__,
           "input_mib": None if base is None else base / 2 ** 20,
           "peak_above_inputs_mib": None if plan is None else plan / 2 ** 20}
    if base is not None and "peak_bytes_in_use" in stats:
        # JAX keeps one peak per process (no reset): compilation's autotuning
        # buffers included, so an upper bound of the step's
        res["process_peak_above_inputs_mib"] = (stats["peak_bytes_in_use"] - base) / 2 ** 20
    return res


def cuda_child(a):
    """A CUDA child: one peer at one shape; prints one JSON line."""
    T = int(a.seq_len)
    try:
        if a.child == "jax_pure":
            res = cuda_child_jax(a, T)
        else:
            res = cuda_child_torch(a, T)
    except ImportError as e:
        res = {"status": f"unavailable (import: {e.name or e})"}
    except Exception as e:  # noqa: BLE001 - a peer's failure is its row
        msg = " ".join(str(e).split())
        res = {"status": f"failed: {type(e).__name__}: {msg[:300]}"}
    print(json.dumps(res))
    return 0


# ------------------------------------------------------------------ parent

def run_child(a, name, T, timeout):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--seq-len", str(T),
           "--device", a.device]
    for k in ("batch", "hidden", "vocab", "dtype", "seed", "reps", "warmup",
              "loss_type", "beta", "temperature", "threads", "memory_budget",
              "liger_chunk_size", "wide_budget"):
        v = getattr(a, k)
        if v is not None:
            cmd += ["--" + k.replace("_", "-"), str(v)]
    if a.liger_compiled:
        cmd.append("--liger-compiled")
    t0 = time.perf_counter()
    import tempfile
    with tempfile.TemporaryFile("w+") as fo, tempfile.TemporaryFile("w+") as fe:
        p = subprocess.Popen(cmd, stdout=fo, stderr=fe, text=True)
        # os.wait4 gives this child's own rusage (ru_maxrss = its peak RSS, KiB)
        ru = None
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid == p.pid:
                p.returncode = os.waitstatus_to_exitcode(status)
                break
            if time.perf_counter() - t0 > timeout:
                p.kill()
                os.wait4(p.pid, 0)
                p.returncode = -9
                return {"status": f"timeout after {timeout:.0f}s",
                        "wall_s": time.perf_counter() - t0}
            time.sleep(0.05)
        fo.seek(0)
        fe.seek(0)
        out, err = fo.read(), fe.read()
    res = None
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            res = json.loads(line)
            break
    if res is None:
        tail = [ln for ln in (err or out).strip().splitlines() if ln.strip()][-3:]
        res = {"status": f"failed (exit {p.returncode}): " + " | ".join(tail)[-300:]}
    res["wall_s"] = time.perf_counter() - t0
    # ru_maxrss restarts with the child's clear_refs: the process peak is the
    # larger of it and the peak the child read just before restarting it
    res["peak_rss_mib"] = max(ru.ru_maxrss / 1024.0, res.get("pre_reset_peak_rss_mib") or 0.0,
                              res.get("step_peak_rss_mib") or 0.0)
    return res


# Shape defaults per device: the CPU's small shape; on CUDA the headline
# shape (B=1, H=4096, V=151936, bf16) at T=8192 and T=32768.
DEFAULTS = {"cpu": dict(batch=2, seq_len="256", hidden=256, vocab=4096, dtype="float32",
                        peers=PEERS, timeout=1800.0),
            "cuda": dict(batch=1, seq_len="8192,32768", hidden=4096, vocab=151936,
                         dtype="bfloat16", peers=CUDA_PEERS, timeout=90.0)}


def print_cpu_table(a, T, rows, out):
    N = a.batch * T
    out(f"\nGRPO step (forward + backward), B={a.batch} T={T} H={a.hidden} "
        f"V={a.vocab} (N={N} tokens), {a.dtype}, loss_type={a.loss_type}, beta={a.beta}, "
        f"median of {a.reps} after {a.warmup} warm-up\n")
    out("| peer | step (ms) | min (ms) | first step (ms) | peak RSS (MiB) | setup RSS (MiB) "
        "| process peak (MiB) | loss | outside C | status |")
    out("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, r in rows:
        if r.get("status") == "ok":
            ov = r.get("front_end_overhead")
            ov = "" if ov is None else f"{100 * ov:+.1f}%"
            step_peak = r.get("step_peak_rss_mib")
            step_peak = "" if step_peak is None else f"{step_peak:.0f}"
            out(f"| {name} | {r['median_s'] * 1e3:.1f} | {r['min_s'] * 1e3:.1f} | "
                f"{r['first_s'] * 1e3:.1f} | {step_peak} | {r['rss_setup_mib']:.0f} | "
                f"{r['peak_rss_mib']:.0f} | {r['loss']:.6g} | {ov} | ok |")
        else:
            out(f"| {name} | | | | | | | | | {r.get('status')} |")


def _f(v, fmt):
    return "" if v is None else format(v, fmt)


def print_cuda_table(a, T, rows, out):
    N = a.batch * T
    gpu = next((r.get("device") for _, r in rows if r.get("device")), "unknown GPU")
    floor = dict(rows).get("gemm_floor", {})
    floor_s = floor.get("median_s") if floor.get("status") == "ok" else None
    out(f"\nGRPO step (forward + backward) on {gpu}, B={a.batch} T={T} H={a.hidden} "
        f"V={a.vocab} (N={N} tokens), {a.dtype}, loss_type={a.loss_type}, beta={a.beta} "
        f"(reference policy log-probs given), median of {a.reps} after {a.warmup} warm-up; "
        f"x floor: step over gemm_floor's; peak: device memory above the inputs over the "
        f"timed steps\n")
    out("| peer | step (ms) | min (ms) | max (ms) | x floor | peak (MiB) | first step (ms) "
        "| loss | status | what |")
    out("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for name, r in rows:
        what = CUDA_NOTES.get(name, "")
        if name == "fusedgrpo_torch_wide" and a.wide_budget:
            what += f" ({a.wide_budget / 2 ** 30:g} GiB)"
        if r.get("status") == "ok":
            ratio = "" if floor_s is None else f"{r['median_s'] / floor_s:.2f}"
            status = "ok"
            if r.get("fg_chunks") is not None:
                status += f"; {r['fg_chunks']} chunks of {r['fg_chunk_rows']} rows"
            if r.get("fg_kept") is not None and r["fg_kept"] < 1:
                status += f"; {100 * r['fg_kept']:.2f}% of dlogits kept"
            if r.get("outside_c") is not None:
                status += f"; outside C {100 * r['outside_c']:+.1f}%"
            if r.get("compile_s") is not None:
                status += f"; compiled before the first step in {r['compile_s']:.1f} s"
            if r.get("process_peak_above_inputs_mib") is not None:
                status += (f"; XLA plan, process peak "
                           f"{r['process_peak_above_inputs_mib']:.0f} MiB")
            out(f"| {name} | {r['median_s'] * 1e3:.2f} | {r['min_s'] * 1e3:.2f} | "
                f"{r['max_s'] * 1e3:.2f} | {ratio} | {_f(r.get('peak_above_inputs_mib'), '.0f')} "
                f"| {r['first_s'] * 1e3:.0f} | {_f(r.get('loss'), '.6g')} | {status} | {what} |")
        else:
            status = str(r.get("status")).replace("|", "/")
            out(f"| {name} | | | | | | | | {status} | {what} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cpu: the CPU peers; cuda: the CUDA peers (CUDA_PEERS)")
    ap.add_argument("--batch", type=int, default=None, help="default 2 (cpu), 1 (cuda)")
    ap.add_argument("--seq-len", default=None,
                    help="T, or several comma-separated (one table each); "
                         "default 256 (cpu), 8192,32768 (cuda)")
    ap.add_argument("--hidden", type=int, default=None, help="default 256 (cpu), 4096 (cuda)")
    ap.add_argument("--vocab", type=int, default=None, help="default 4096 (cpu), 151936 (cuda)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="default float32 (cpu), bfloat16 (cuda)")
    ap.add_argument("--loss-type", default="dapo", choices=["dapo", "bnpo", "grpo"])
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="threads for every peer")
    ap.add_argument("--memory-budget", type=int, default=None,
                    help="fusedgrpo working-memory budget in bytes (default 256 MiB)")
    ap.add_argument("--wide-budget", type=int, default=None,
                    help="cuda: fusedgrpo_torch_wide's budget in bytes (default 4 GiB: the "
                         "float32 grad_weight sums of V=151936, H=4096 and chunks of ~1700 rows)")
    ap.add_argument("--liger-compiled", action="store_true",
                    help="cpu: Liger with compiled=True (torch.compile of its loss math); "
                         "on cuda both are peers")
    ap.add_argument("--liger-chunk-size", type=int, default=1)
    ap.add_argument("--peers", default=None, help="comma-separated subset")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per child (default 1800 cpu, 90 cuda)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds for the whole run: a child gets at most what is left, and "
                         "one that would start with less than 10 s left is a row 'not run'")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--out", help="folder for peers.md and peers.json (rewritten after "
                                  "every row, so a run cut short leaves what it measured)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    d = DEFAULTS[a.device]
    for k in ("batch", "seq_len", "hidden", "vocab", "dtype", "timeout"):
        if getattr(a, k) is None:
            setattr(a, k, d[k])
    if a.device == "cuda" and a.wide_budget is None:
        a.wide_budget = 4 << 30
    if a.child:
        a.seq_len = int(a.seq_len)
        return cuda_child(a) if a.device == "cuda" else child(a)

    known = d["peers"]
    names = [n.strip() for n in (a.peers or ",".join(known)).split(",") if n.strip()]
    for name in names:
        if name not in known:
            ap.error(f"unknown peer {name!r} on {a.device}; one of {known}")
    shapes = [int(t) for t in str(a.seq_len).split(",")]
    start = time.perf_counter()
    results = []  # (T, rows)
    print_table = print_cuda_table if a.device == "cuda" else print_cpu_table

    def write_outputs():
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            lines = []
            for T, rows in results:
                print_table(a, T, rows, lines.append)
            with open(os.path.join(a.out, "peers.md"), "w") as f:
                f.write("\n".join(lines).lstrip("\n") + "\n")
        if a.device == "cpu" and len(shapes) == 1:
            doc = {"args": vars(a), "rows": results[0][1] if results else []}  # as it always was
        else:
            doc = {"args": vars(a), "shapes": [{"B": a.batch, "T": T, "H": a.hidden,
                                                "V": a.vocab, "dtype": a.dtype, "rows": rows}
                                               for T, rows in results]}
        for path in ([os.path.join(a.out, "peers.json")] if a.out else []) + (
                [a.json] if a.json else []):
            with open(path, "w") as f:
                json.dump(doc, f, indent=1)

    for T in shapes:
        rows = []
        results.append((T, rows))
        for name in names:
            timeout = a.timeout
            if a.deadline is not None:
                left = a.deadline - (time.perf_counter() - start)
                if left < 10:
                    rows.append((name, {"status": f"not run: the {a.deadline:.0f} s time "
                                                  "limit of the run was near"}))
                    continue
                timeout = min(timeout, left - 2)
            res = run_child(a, name, T, timeout)
            rows.append((name, res))
            print(f"[peers] T={T} {name}: {res.get('status')} ({res.get('wall_s', 0):.1f} s)",
                  file=sys.stderr, flush=True)
            write_outputs()
        write_outputs()

    for T, rows in results:
        print_table(a, T, rows, print)
    return 0


if __name__ == "__main__":
    sys.exit(main())
