"""One process of test_many_gpus_fsdp.py, and what its one-process reference
shares with it:

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        fsdp_worker.py MODEL_DIR TRAINER_MODEL_DIR OUT_DIR

Each case shards a tiny Llama (add_fusedgrpo_lm_head applied; untied, tied
for the "_tied" cases) over the gloo group, gives each rank its half of one batch, and runs two passes, each
forward and backward on its own: the fused log-probs (``fused_lm_head=True``,
whose backward recomputes the logits from the weight) with a loss of them,
and the fused GRPO loss in the head's place (``fusedgrpo_head=``, dapo with
num_items_in_batch = global tokens / world, TRL's normalisation). Rank 0
saves, per pass, the mean of the ranks' losses, the gathered log-probs and
every parameter's whole gradient; the test compares them with one process on
the whole batch (``reference``).

Cases: FSDP2 (fully_shard) with the head in the root group, in a group of
final norm + head, alone, alone read outside its forward
(``fusedgrpo_hidden=True``: the DTensor gathered by fusedgrpo), and tied to
the embedding (tiny_llama's own model) in the embedding's group; FSDP1 with
the head wrapped alone, use_orig_params True and False (and the refusal of
each one's shard read outside the head's forward); DeepSpeed ZeRO-3 through
deepspeed.initialize, untied and tied (and the refusal of its parameter
handed out of the forward) when deepspeed imports; FusedGRPOTrainer for two
SGD steps on transformers' own FSDP2 (``from_pretrained(distributed_config=
...)``, the head its own group).
"""
from __future__ import annotations

import datetime
import functools
import os
import sys
import traceback

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

V = 97
B, P, C = 4, 3, 7  # the whole batch: 4 sequences, prompt and completion lengths
LENS = [C, 3, C - 2, 1]  # ragged completions (the ranks hold different token counts)
LR = 0.5  # the trainer case's SGD steps: large enough to move the second step's loss
CASES = ("fsdp2_root", "fsdp2_norm_head", "fsdp2_head", "fsdp2_head_outside", "fsdp2_tied",
         "fsdp1_orig", "fsdp1_flat", "zero3", "zero3_tied")


def model_of(name, model_dir):
    """The "_tied" cases' model: tiny_llama's own, the head the embedding."""
    return os.path.join(model_dir, "tied") if name.endswith("_tied") else model_dir


# ------------------------------------------------------------ shared with the test

def save_untied_llama(d):
    """tiny_llama's model with its own LM head (untied: the head can be a
    group of its own), saved with its tokenizer to d."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    from tiny_llama import save_tiny_llama

    tied = os.path.join(d, "tied")
    save_tiny_llama(tied, V)
    src = AutoModelForCausalLM.from_pretrained(tied)
    cfg = src.config
    cfg.tie_word_embeddings = False
    torch.manual_seed(1)
    model = LlamaForCausalLM(cfg)
    state = src.state_dict()
    emb = state["model.embed_tokens.weight"]
    state["lm_head.weight"] = emb + 0.5 * torch.randn(emb.shape)
    model.load_state_dict(state)
    model.save_pretrained(d)
    AutoTokenizer.from_pretrained(tied).save_pretrained(d)


def whole_batch():
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, V - 3, (B, P), generator=g)
    completion = torch.randint(0, V - 3, (B, C), generator=g)
    cmask = torch.tensor([[1 if t < n else 0 for t in range(C)] for n in LENS])
    input_ids = torch.cat([prompt, completion], 1)
    attention_mask = torch.cat([torch.ones(B, P, dtype=torch.long), cmask], 1)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :P] = -100
    return dict(prompt_ids=prompt, prompt_mask=torch.ones(B, P, dtype=torch.long),
                completion_ids=completion, completion_mask=cmask, input_ids=input_ids,
                attention_mask=attention_mask, labels=labels,
                advantages=torch.tensor([0.9, -0.7, 1.3, -1.1]),
                noise=0.3 * torch.randn(B, C, generator=g), tokens=float(cmask.sum()))


def rows(batch, rank, world):
    """This rank's sequences of the batch (contiguous, B / world of them)."""
    n = B // world
    return {k: v[rank * n:(rank + 1) * n] if isinstance(v, torch.Tensor) and v.dim() else v
            for k, v in batch.items()}


def logprob_pass(model, b, world):
    """The fused log-probs and a loss of them normalised as TRL normalises
    dapo's (global tokens / world: the mean over ranks is the batch's)."""
    out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"],
                fused_lm_head=True)
    return -out.log_probs.sum() / (b["tokens"] / world), out.log_probs[:, -C:]


def _grpo_in_head(b, world, hidden, weight, bias):
    from fusedgrpo.torch import fused_linear_grpo_loss

    loss, _, logp, _ = fused_linear_grpo_loss(
        hidden[:, -C:], weight, b["completion_ids"], b["completion_mask"], b["advantages"], bias,
        b["old"], None, loss_type="dapo", beta=0.0, epsilon_low=0.2, epsilon_high=0.28,
        num_items_in_batch=b["tokens"] / world)
    return loss, logp


def grpo_pass(model, b, world, outside=False):
    """The fused GRPO loss in the LM head's place (``fusedgrpo_head=``), or
    with the head read outside its forward (``fusedgrpo_hidden=True``)."""
    fn = functools.partial(_grpo_in_head, b, world)
    if outside:
        hidden, weight, bias = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                                     fusedgrpo_hidden=True)
        return fn(hidden, weight, bias)
    return model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], fusedgrpo_head=fn)


def with_old_logp(b, logp):
    """The old policy's log-probs: the policy's own (the log-prob pass, no
    gradient) moved by the batch's noise, so that some ratios clip."""
    return dict(b, old=(logp.detach() + b["noise"]) * b["completion_mask"])


def reference(model_dir):
    """One process, the whole batch, no sharding: what every case must give."""
    from transformers import AutoModelForCausalLM
    from fusedgrpo.trl import add_fusedgrpo_lm_head

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    add_fusedgrpo_lm_head(model)
    return run_passes(model, whole_batch(), 1, _plain_grads, _identity, lambda m: m.zero_grad())


def _identity(t, mean=False):
    return t


def _plain_grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def run_passes(model, b, world, grads, gather, zero, backward=None, outside=False):
    """Both passes on this rank's rows b: {pass: (loss, logp, grads)}, the
    loss averaged over the ranks and the log-probs gathered (``gather``)."""
    backward = backward or (lambda loss: loss.backward())
    with torch.no_grad():
        _, logp0 = logprob_pass(model, b, world)
    b = with_old_logp(b, logp0)
    out = {"nograd_logp": gather(logp0)}
    for name, fn in (("logprobs", logprob_pass),
                     ("grpo", functools.partial(grpo_pass, outside=outside))):
        zero(model)
        loss, logp = fn(model, b, world)
        backward(loss)
        out[name] = (gather(loss.detach().reshape(1), mean=True)[0], gather(logp.detach()),
                     grads(model))
    return out


# ------------------------------------------------------------ the sharded runs

def _gather(t, mean=False):
    import torch.distributed as dist

    if mean:
        t = t.clone()
        dist.all_reduce(t)
        return t / dist.get_world_size()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, 0)


def _load(model_dir):
    from transformers import AutoModelForCausalLM
    from fusedgrpo.trl import add_fusedgrpo_lm_head

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    add_fusedgrpo_lm_head(model)
    return model


def fsdp2(model_dir, head):
    """fully_shard: each decoder layer, then the head ("root": left in the
    root group; "norm_head": one group with the final norm; "head": alone;
    "tied": one group with the embedding, kept unsharded from its forward
    to its backward, as transformers' plan shards tied embeddings)."""
    from torch.distributed.fsdp import fully_shard

    model = _load(model_dir)
    for layer in model.model.layers:
        fully_shard(layer)
    if head == "norm_head":
        fully_shard([model.model.norm, model.lm_head])
    elif head == "head":
        fully_shard(model.lm_head)
    elif head == "tied":
        assert model.lm_head.weight is model.model.embed_tokens.weight
        fully_shard([model.model.embed_tokens, model.lm_head], reshard_after_forward=False)
    fully_shard(model)
    return model


def _fsdp2_grads(model):
    from torch.distributed.tensor import DTensor

    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in model.named_parameters() if p.grad is not None}


def fsdp1(model_dir, use_orig_params):
    """FSDP1 wrapping each decoder layer and the LM head in units of their own."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = _load(model_dir)
    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(
        m, LlamaDecoderLayer) or m is model.lm_head)
    return FSDP(model, auto_wrap_policy=policy, use_orig_params=use_orig_params,
                device_id=torch.device("cpu"))


def _clean(name):
    return name.replace("_fsdp_wrapped_module.", "")


def _fsdp1_grads(wrapped):
    """Whole gradients under FSDP1: its own summon_full_params(with_grads)
    with use_orig_params=True; otherwise each unit's flat gradient shard,
    gathered and split at the flat parameter's recorded layout."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if wrapped._use_orig_params:
        with FSDP.summon_full_params(wrapped, with_grads=True):
            return {_clean(n): p.grad.detach().clone() for n, p in wrapped.named_parameters()
                    if p.grad is not None}
    out = {}
    for prefix, unit in wrapped.named_modules():
        if not isinstance(unit, FSDP) or unit._handle is None:
            continue
        flat = unit._handle.flat_param
        whole = _gather(flat.grad.detach())[:flat._unpadded_unsharded_size.numel()]
        pieces = [p for pad, p in zip(flat._is_padding_mask,
                                      whole.split(list(flat._numels_with_padding))) if not pad]
        base = _clean(prefix + "." if prefix else "")
        for fqn, shape, piece in zip(flat._fqns, flat._shapes, pieces):
            out[base + _clean(fqn)] = piece.reshape(shape).clone()
    return out


def _fsdp1_zero(wrapped):
    wrapped.zero_grad(set_to_none=True)


def zero3(model_dir):
    """DeepSpeed ZeRO-3 over the gloo group (its CPU accelerator), every
    parameter partitioned (no persistence threshold)."""
    import deepspeed
    import deepspeed.comm.torch as ds_torch_comm

    # deepspeed compiles a shared-memory all-reduce for CPU groups on first
    # use (minutes); gloo's own collectives serve these sizes.
    ds_torch_comm.build_shm_op = lambda: None
    model = _load(model_dir)
    cfg = {"train_micro_batch_size_per_gpu": B // 2, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                      optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
    return engine


def _zero3_grads(engine):
    from deepspeed.utils import safe_get_full_grad

    out = {}
    for n, p in engine.module.named_parameters():
        g = safe_get_full_grad(p)
        if g is not None:
            out[n] = g.detach().clone()
    return out


def _zero3_zero(engine):
    engine.optimizer.zero_grad(set_to_none=True)


def refusal(model, b, world):
    """The message a head read outside its forward is refused with (None: accepted)."""
    from fusedgrpo import FusedGRPOError

    try:
        grpo_pass(model, with_old_logp(b, torch.zeros(b["noise"].shape)), world, outside=True)
    except FusedGRPOError as e:
        return str(e)
    return None


def run_case(name, model_dir, rank, world):
    b = rows(whole_batch(), rank, world)
    model_dir = model_of(name, model_dir)
    if name.startswith("fsdp2"):
        model = fsdp2(model_dir, name[len("fsdp2_"):].replace("_outside", ""))
        return run_passes(model, b, world, _fsdp2_grads, _gather,
                          lambda m: m.zero_grad(set_to_none=True),
                          outside=name.endswith("outside"))
    if name.startswith("fsdp1"):
        model = fsdp1(model_dir, use_orig_params=name == "fsdp1_orig")
        out = run_passes(model, b, world, _fsdp1_grads, _gather, _fsdp1_zero)
        out["refused"] = refusal(model, b, world)
        return out
    engine = zero3(model_dir)
    out = run_passes(engine, b, world, _zero3_grads, _gather, _zero3_zero,
                     backward=engine.backward)
    out["refused"] = refusal(engine, b, world)
    return out


# ------------------------------------------------------------ the trainer

def make_trainer(model_dir, out_dir, **model_init_kwargs):
    from datasets import Dataset
    from trl import GRPOConfig
    from fusedgrpo.trl import FusedGRPOTrainer

    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=C, report_to=[], use_cpu=True, bf16=False,
                      loss_type="dapo", beta=0.04, logging_steps=1, save_strategy="no",
                      model_init_kwargs=model_init_kwargs or None)
    ds = Dataset.from_dict({"prompt": ["t1 t2 t3"] * 4})
    tr = FusedGRPOTrainer(model=model_dir, reward_funcs=lambda completions, **k: [0.0] *
                          len(completions), args=args, train_dataset=ds)
    tr.model.train()
    return tr


def trainer_steps(tr, rank, world, grads, gather):
    """Two SGD steps of FusedGRPOTrainer's _compute_loss on this rank's rows:
    per step the old / reference log-prob passes (the trainer's own), the
    loss (mean over ranks), every gradient, and TRL's kl and entropy."""
    b = rows(whole_batch(), rank, world)
    opt = torch.optim.SGD(tr.model.parameters(), lr=LR)
    tr.current_gradient_accumulation_steps = 1  # what TRL's training_step sets
    ids = torch.cat([b["prompt_ids"], b["completion_ids"]], 1)
    am = torch.cat([b["prompt_mask"], b["completion_mask"]], 1)
    steps = []
    for _ in range(2):
        with torch.no_grad():
            logp, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, am, C)
            ref, _, _ = tr._get_per_token_logps_and_entropies(tr.ref_model, ids, am, C)
        inputs = dict(prompt_ids=b["prompt_ids"], prompt_mask=b["prompt_mask"],
                      completion_ids=b["completion_ids"], completion_mask=b["completion_mask"],
                      advantages=b["advantages"], old_per_token_logps=logp + b["noise"],
                      ref_per_token_logps=ref, num_items_in_batch=torch.tensor(b["tokens"]))
        tr._metrics["train"].clear()
        opt.zero_grad(set_to_none=True)
        loss = tr._compute_loss(tr.model, inputs)
        loss.backward()
        steps.append(dict(loss=gather(loss.detach().reshape(1), mean=True)[0],
                          logp=gather(logp), ref=gather(ref), grads=grads(tr.model),
                          kl=tr._metrics["train"]["kl"][-1],
                          entropy=tr._metrics["train"]["entropy"][-1]))
        opt.step()
    return steps


def trainer_reference(model_dir, out_dir):
    return trainer_steps(make_trainer(model_dir, out_dir), 0, 1, _plain_grads, _identity)


def trainer_case(model_dir, out_dir, rank, world):
    """transformers' FSDP2 (DistributedConfig): each layer, the final norm
    and the LM head in groups of their own (the model's plan keeps the head
    unsharded between forward and backward; by default it groups the norm
    with the head, which gathers the head in the norm's forward)."""
    from torch.distributed.fsdp import FSDPModule
    from transformers.distributed import DistributedConfig

    tr = make_trainer(model_dir, out_dir, distributed_config=DistributedConfig(
        fsdp_size=world, fsdp_plan={"model.norm": "free_full_weight"}))
    head = tr.model.get_output_embeddings()
    assert isinstance(head, FSDPModule)
    assert len(head._get_fsdp_state()._fsdp_param_group.fsdp_params) == 1  # the head alone
    return trainer_steps(tr, rank, world, _fsdp2_grads, _gather)


# ------------------------------------------------------------ main

def main(model_dir, trainer_model_dir, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    # a collective that waits longer raises: a hang fails its test
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for name in CASES:
        try:
            results[name] = run_case(name, model_dir, rank, world)
        except ImportError as e:  # deepspeed not installed: the test skips with this
            results[name] = {"skipped": f"{type(e).__name__}: {e}"}
        except Exception:  # noqa: BLE001 - the test reports it per case
            results[name] = {"error": traceback.format_exc()}
    try:
        results["trainer"] = trainer_case(trainer_model_dir, os.path.join(out_dir, "tr"), rank,
                                          world)
    except Exception:  # noqa: BLE001
        results["trainer"] = {"error": traceback.format_exc()}
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(*sys.argv[1:4])
