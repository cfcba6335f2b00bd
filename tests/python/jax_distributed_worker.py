"""One process of tests/python/test_jax_distributed.py (run by it, not by pytest).

    python jax_distributed_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_JSON

Joins a jax.distributed job on 127.0.0.1:PORT (CPU collectives over gloo),
each process with 2 host devices, and runs fusedgrpo.jax's
fused_linear_grpo_loss_sharded on meshes over the processes' devices:

  vocab        (vocab,)        one device per process: the vocab split across processes
  batch        (batch,)        one device per process: data parallel across processes
  batch_vocab  (batch, vocab)  vocab across processes, batch within each
  vocab_batch  (batch, vocab)  batch across processes, vocab within each

Each case is compared with the single-process call (fused_linear_grpo_loss on
the whole weight and batch, on this process's own device), with V = 301 (odd:
the shards are uneven, or the weight comes padded with vocab_size = 301). The
errors: one process holds a bad token id or NaN input; every process must
raise the same status. Writes {"cases": {name: errors}, "failures": {name:
message}} to OUT_JSON; the test asserts on it.
"""
import hashlib
import json
import os
import sys
import time
import traceback

import numpy as np

PID, NPROC, PORT, OUT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{PORT}", num_processes=NPROC,
                           process_id=PID, initialization_timeout=120,
                           shutdown_timeout_seconds=60)

import jax.numpy as jnp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import fusedgrpo.jax as fgj  # noqa: E402
from grpo_reference import make_inputs, reference  # noqa: E402

B, T, H, V = 4, 7, 13, 301
FIELDS = ("hidden", "weight", "token_ids", "mask", "advantages", "old_logp", "ref_logp")


def meshes():
    by_proc = [[d for d in jax.devices() if d.process_index == p] for p in range(NPROC)]
    first = [devs[0] for devs in by_proc]
    second = [devs[1] for devs in by_proc]
    return {
        "vocab": Mesh(np.array(first), ("vocab",)),
        "batch": Mesh(np.array(first), ("batch",)),
        "batch_vocab": Mesh(np.array([first, second]), ("batch", "vocab")),
        "vocab_batch": Mesh(np.array(by_proc), ("batch", "vocab")),
    }


def global_array(mesh, spec, value):
    """A global array of `value` (this process's copy: a process may hold a
    different one, which is how a test gives one process bad input)."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec),
                                        lambda idx: value[idx])


def full(x):
    """The whole of a global array, on every process."""
    return np.asarray(multihost_utils.process_allgather(x, tiled=True), np.float64)


def rel(got, want, scale=None):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    diff = float(np.max(np.abs(got - want))) if got.size else 0.0
    scale = float(np.max(np.abs(want))) if scale is None else scale
    return diff / scale if diff else 0.0


def sharded_inputs(mesh, inp, batch_axis, vocab_axis, padded_weight):
    """The inputs as global arrays, laid out as the sharded call reads them: the
    batch's over batch_axis, the weight's rows over vocab_axis (padded to 302
    rows, or whole and replicated for the call to pad)."""
    bspec = P(batch_axis) if batch_axis else P()
    vspec = P(vocab_axis) if vocab_axis and padded_weight else P()
    w, b = inp["weight"], inp["bias"]
    if padded_weight:
        w = np.concatenate([w, np.zeros((1, H), w.dtype)])
        b = np.concatenate([b, np.zeros(1, b.dtype)])
    out = {k: global_array(mesh, bspec, inp[k]) for k in FIELDS if k != "weight"}
    out["weight"] = global_array(mesh, vspec, w)
    out["bias"] = global_array(mesh, vspec, b)
    if inp.get("is_ratio") is not None:
        out["is_ratio"] = global_array(mesh, bspec, inp["is_ratio"])
    return out


def value_and_grads(fn, inp, cfg):
    """(loss, aux), (grad_hidden, grad_weight, grad_bias) under jit; every input an
    argument (a jitted function may not close over arrays of other processes)."""
    def f(h, w, b, rest):
        a = {**rest, "hidden": h, "weight": w}
        return fn(*(a[k] for k in FIELDS), bias=b, is_ratio=rest.get("is_ratio"),
                  return_aux=True, threads=1, **cfg)
    rest = {k: v for k, v in inp.items() if k not in ("hidden", "weight", "bias")}
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(
        inp["hidden"], inp["weight"], inp["bias"], rest)


def run_case(ms, name, mesh_name, cfg, seed, padded_weight=False, is_ratio=False):
    mesh = ms[mesh_name]
    batch_axis = "batch" if "batch" in mesh.axis_names else None
    vocab_axis = "vocab" if "vocab" in mesh.axis_names else None
    inp = make_inputs(np.random.default_rng(seed), B=B, T=T, H=H, V=V, all_masked_row=2)
    if is_ratio:
        inp["is_ratio"] = np.random.default_rng(seed + 1).uniform(0.7, 1.3, (B, T)).astype(
            np.float32)
    t0 = time.time()
    (l1, aux1), g1 = value_and_grads(fgj.fused_linear_grpo_loss,
                                     {k: v for k, v in inp.items() if v is not None}, cfg)
    g_inp = sharded_inputs(mesh, inp, batch_axis, vocab_axis, padded_weight)
    kw = dict(batch_axis=batch_axis, vocab_axis=vocab_axis,
              vocab_size=V if padded_weight else None)
    (l2, aux2), g2 = value_and_grads(
        lambda *a, **k: fgj.fused_linear_grpo_loss_sharded(mesh, *a, **kw, **k), g_inp, cfg)
    scale = max(reference(**inp, **cfg)["loss_scale"], abs(float(l1)))
    errs = {"loss": rel(full(l2), float(l1), scale),
            "logp": rel(full(aux2["logp"]), aux1["logp"]),
            "entropy": rel(full(aux2["entropy"]), aux1["entropy"])}
    for k in ("kl", "entropy", "clip_ratio_region", "policy_loss"):
        want = float(aux1["metrics"][k])
        errs["metric_" + k] = rel(full(aux2["metrics"][k]), want, max(abs(want), 1.0))
    for n, a, b in zip(("grad_hidden", "grad_weight", "grad_bias"), g2, g1):
        a = full(a)
        if n == "grad_hidden":
            errs[n] = rel(a, b)
            continue
        errs[n] = rel(a[:V], b)
        if padded_weight:  # the padded weight's last row: never in a call, zero gradient
            errs[n + "_padding"] = float(np.max(np.abs(a[V:])))
    # this process's own copies: the loss, and its log-probs' bits (on the vocab
    # mesh, the whole [B, T], which every vocab shard must hold identically)
    errs["loss_value"] = float(np.asarray(l2.addressable_shards[0].data))
    errs["logp_sha"] = hashlib.sha256(
        np.asarray(aux2["logp"].addressable_shards[0].data).tobytes()).hexdigest()
    errs["seconds"] = time.time() - t0
    return errs


def run_failure(ms, mesh_name, seed, bad):
    """This process (or the other) holds a bad token id or NaN hidden states in
    its copy of the inputs; returns the message every process must raise."""
    mesh = ms[mesh_name]
    batch_axis = "batch" if "batch" in mesh.axis_names else None
    vocab_axis = "vocab" if "vocab" in mesh.axis_names else None
    inp = make_inputs(np.random.default_rng(seed), B=B, T=T, H=H, V=V)
    victim = 1 % NPROC
    if PID == victim:
        # a row this process holds under either layout: its first sequence of the
        # batch shard it holds, or row 0 when the batch is replicated
        row = (B // NPROC) * victim if batch_axis == "batch" and mesh_name != "batch_vocab" else 0
        if bad == "token":
            inp["token_ids"] = inp["token_ids"].copy()
            inp["mask"][row, 0] = True
            inp["token_ids"][row, 0] = V + 7
        else:
            inp["hidden"] = inp["hidden"].copy()
            inp["hidden"][row, 0, 3] = np.nan
    g_inp = sharded_inputs(mesh, inp, batch_axis, vocab_axis, False)
    try:
        (loss, _), g = value_and_grads(
            lambda *a, **k: fgj.fused_linear_grpo_loss_sharded(
                mesh, *a, batch_axis=batch_axis, vocab_axis=vocab_axis, **k),
            g_inp, dict(loss_type="dapo", beta=0.04))
        jax.block_until_ready((loss, g))
    except Exception as e:  # noqa: BLE001 - the test asserts on the message
        return str(e)
    return "no error"


CASES = [
    # name, mesh, config, seed, padded weight (vocab_size = 301), is_ratio
    ("vocab/dapo_token", "vocab", dict(loss_type="dapo", temperature=0.9), 1, False, False),
    ("vocab/grpo_sequence_beta", "vocab",
     dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.05, entropy_coef=0.01),
     2, True, False),
    ("vocab/cispo_token_beta", "vocab",
     dict(loss_type="cispo", beta=0.04, epsilon_high=1.2, temperature=0.7), 3, False, True),
    ("vocab/vespo_sequence", "vocab",
     dict(loss_type="vespo", importance_sampling_level="sequence"), 4, True, False),
    ("batch/dapo_token_beta", "batch", dict(loss_type="dapo", beta=0.04, entropy_coef=0.02), 5,
     False, False),
    ("batch_vocab/bnpo_token_entropy", "batch_vocab",
     dict(loss_type="bnpo", beta=0.1, entropy_coef=0.02), 6, True, False),
    ("vocab_batch/luspo_sequence", "vocab_batch",
     dict(loss_type="luspo", importance_sampling_level="sequence", beta=0.02), 7, False, False),
]

FAILURES = [
    ("vocab/bad_token", "vocab", "token"),
    ("vocab/nan_hidden", "vocab", "nan"),
    ("batch/bad_token", "batch", "token"),
    ("vocab_batch/nan_hidden", "vocab_batch", "nan"),
]


def main():
    ms = meshes()
    out = {"process": PID, "cases": {}, "failures": {}}
    only = os.environ.get("FG_JAX_DIST_CASES")  # a comma-separated subset, for debugging
    for name, mesh_name, cfg, seed, padded, isr in CASES:
        if not only or name in only.split(","):
            out["cases"][name] = run_case(ms, name, mesh_name, cfg, seed, padded, isr)
    for i, (name, mesh_name, bad) in enumerate(FAILURES):
        if not only or name in only.split(","):
            out["failures"][name] = run_failure(ms, mesh_name, 100 + i, bad)
    # the mesh still works after the failures: the first case again, the same numbers
    if not only:
        name, mesh_name, cfg, seed, padded, isr = CASES[0]
        out["cases"][name + "/after_failures"] = run_case(ms, name, mesh_name, cfg, seed,
                                                          padded, isr)
    with open(OUT, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    try:
        main()
    except Exception:  # noqa: BLE001 - reported through the exit status and stderr
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)  # not jax.distributed's shutdown barrier: the other process may be gone
    jax.distributed.shutdown()
