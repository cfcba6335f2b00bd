#!/usr/bin/env python3
"""Peers side by side: one GRPO training step (forward + backward through the LM
head) on the same inputs, each peer in its own subprocess:

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

  python bench/peers/run_peers.py                       # small default shape
  python bench/peers/run_peers.py --seq-len 2048 --hidden 2048 --vocab 151936 --dtype bfloat16
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


# ------------------------------------------------------------------ parent

def run_child(a, name):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name]
    for k in ("batch", "seq_len", "hidden", "vocab", "dtype", "seed", "reps", "warmup",
              "loss_type", "beta", "temperature", "threads", "memory_budget",
              "liger_chunk_size"):
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
            if time.perf_counter() - t0 > a.timeout:
                p.kill()
                os.wait4(p.pid, 0)
                p.returncode = -9
                return {"status": f"timeout after {a.timeout:.0f}s"}
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--loss-type", default="dapo", choices=["dapo", "bnpo", "grpo"])
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="threads for every peer")
    ap.add_argument("--memory-budget", type=int, default=None,
                    help="fusedgrpo working-memory budget in bytes (default 256 MiB)")
    ap.add_argument("--liger-compiled", action="store_true",
                    help="Liger with compiled=True (torch.compile of its loss math)")
    ap.add_argument("--liger-chunk-size", type=int, default=1)
    ap.add_argument("--peers", default=",".join(PEERS), help="comma-separated subset")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)

    rows = []
    for name in a.peers.split(","):
        name = name.strip()
        if name not in PEERS:
            ap.error(f"unknown peer {name!r}; one of {PEERS}")
        res = run_child(a, name)
        rows.append((name, res))
        print(f"[peers] {name}: {res.get('status')}", file=sys.stderr, flush=True)

    N = a.batch * a.seq_len
    print(f"\nGRPO step (forward + backward), B={a.batch} T={a.seq_len} H={a.hidden} "
          f"V={a.vocab} (N={N} tokens), {a.dtype}, loss_type={a.loss_type}, beta={a.beta}, "
          f"median of {a.reps} after {a.warmup} warm-up\n")
    print("| peer | step (ms) | min (ms) | first step (ms) | peak RSS (MiB) | setup RSS (MiB) "
          "| process peak (MiB) | loss | outside C | status |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, r in rows:
        if r.get("status") == "ok":
            ov = r.get("front_end_overhead")
            ov = "" if ov is None else f"{100 * ov:+.1f}%"
            step_peak = r.get("step_peak_rss_mib")
            step_peak = "" if step_peak is None else f"{step_peak:.0f}"
            print(f"| {name} | {r['median_s'] * 1e3:.1f} | {r['min_s'] * 1e3:.1f} | "
                  f"{r['first_s'] * 1e3:.1f} | {step_peak} | {r['rss_setup_mib']:.0f} | "
                  f"{r['peak_rss_mib']:.0f} | {r['loss']:.6g} | {ov} | ok |")
        else:
            print(f"| {name} | | | | | | | | | {r.get('status')} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
