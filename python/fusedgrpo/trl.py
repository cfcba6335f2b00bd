"""fusedgrpo for Hugging Face TRL: ``FusedGRPOTrainer``, a drop-in for ``trl.GRPOTrainer``.

Constructed exactly like ``trl.GRPOTrainer`` (TRL 1.16). Its ``_compute_loss``
runs the model's backbone, then fusedgrpo's fused loss on the last hidden
states and the LM head (tied embeddings included): the loss, its gradient and
TRL's metrics come from one C call per micro-batch, the ``[tokens, vocab]``
logits never exist, and neither TRL's chunked LM-head kernel nor a
``log_softmax`` runs. The old- and reference-policy log-prob passes (TRL's
``_get_per_token_logps_and_entropies``) run ``fg_linear_logprobs``: one GEMM
per token, no gradient.

What the trainer keeps of TRL's own: generation, rewards, advantages, the
gradient-accumulation and world-size scaling of the normalisers (handed to the
C call as ``num_items_in_batch`` and a scale of the loss, docs/LOSS_SPEC.md
"Aggregation"), the adaptive entropy coefficient, and the metric logging (the
C call's metrics, reduced across processes as TRL reduces its own).

Many processes: the loss and the log-probs run as the LM head module's own
forward (add_fusedgrpo_lm_head; fusedgrpo.sharded_weight), inside the model's
forward, so that DDP, FSDP2 (``fully_shard``, or transformers'
``from_pretrained(distributed_config=DistributedConfig(fsdp_size=N))``),
FSDP1 and DeepSpeed ZeRO-3 gather a sharded head for it, gather it again for
a backward that reads it, and average its gradient over the ranks as they
do the model's own head; TRL's normalisers assume that average.

Refused with a clear error rather than ignored: multimodal inputs, MoE router
aux losses, per-token advantages ``[B, T]``, models whose head scales or
soft-caps its logits (``logit_scale``, ``final_logit_softcapping``).

Devices: the model's, CPU or CUDA. Every tensor of the loss path stays where
the model put it: the hidden states, the head's weight and bias, the batch's
ids, masks, advantages and log-probs go to fusedgrpo.torch's ops as they are,
which on CUDA tensors run the library's CUDA backend on torch's current
stream; the loss, gradients, log-probs, entropies and metrics come back on
that device. The host reads scalars only: num_items_in_batch (an option of the
C call) and the logged metrics (as TRL's own logging does). Gradient
filtering (``fusedgrpo_filter_eps``; default 0, off) runs on both; on CUDA
a chunk runs sparse products only where it keeps at most V/256 entries a row
(the same kept entries either way).
"""
from __future__ import annotations

import functools
import types
from contextlib import nullcontext

import torch

try:
    import trl
    from trl import GRPOTrainer
    from trl.trainer.utils import FusedCausalLMOutput, nanmax, nanmin
except ImportError as e:  # pragma: no cover - the module is useless without TRL
    raise ImportError("fusedgrpo.trl needs TRL (pip install trl)") from e

from . import _lib, _options
from ._lib import FusedGRPOError
from .sharded_weight import call_in_head, whole_head
from .torch import fused_linear_grpo_loss, linear_logprobs


def _on_every_rank(fn, *args, **kwargs):
    """A fusedgrpo call; under DDP (more than one process) with one status
    all_reduce after it, so that a rank whose call fails (a bad token id, NaN,
    a bad argument of any exception type) makes every rank raise instead of
    leaving them in DDP's gradient allreduce (fusedgrpo.torch_distributed.agreed)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from .torch_distributed import agreed
        return agreed(fn, *args, **kwargs)
    return fn(*args, **kwargs)

__all__ = ["FusedGRPOTrainer", "add_fusedgrpo_lm_head"]

_CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def _head_scaling(model):
    cfg = model.config.get_text_config()
    for name in ("final_logit_softcapping", "logit_scale", "output_multiplier",
                 "lm_head_multiplier", "logits_scaling"):
        v = getattr(cfg, name, None)
        if v is not None and not (name != "final_logit_softcapping" and v == 1.0):
            return name
    return None


def _head_operands(hidden, weight, bias, cast_lm_head_to_fp32):
    """hidden, weight and bias in the dtype the head multiplies in."""
    hidden = hidden.to(weight.device)
    dev = hidden.device.type
    if cast_lm_head_to_fp32:
        return hidden.float(), weight.float(), None if bias is None else bias.float()
    if torch.is_autocast_enabled(dev):
        # Under autocast (TRL's bf16=True) the head multiplies in the autocast
        # dtype, as the model's own nn.Linear would; fusedgrpo keeps the
        # logits in float32 where autocast would round them to bf16.
        dt = torch.get_autocast_dtype(dev)
        return hidden.to(dt), weight.to(dt), None if bias is None else bias.to(dt)
    if hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    return hidden, weight, bias


def add_fusedgrpo_lm_head(model, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False):
    """Patches ``model.forward`` like TRL's ``add_fused_lm_head``, with fusedgrpo
    behind it. The backbone runs, then the head's work runs *as the LM head
    module's forward* (fusedgrpo.sharded_weight.call_in_head), so that FSDP2,
    FSDP1 and DeepSpeed ZeRO-3 gather the head's weight for it and reduce its
    gradient as they do for the model's own head:

    - ``model(..., labels=labels, fused_lm_head=True)`` returns a
      ``FusedCausalLMOutput`` with ``log_probs`` and ``entropy`` of the
      labelled positions (fused, differentiable through
      fg_linear_logprobs_backward; under ``torch.no_grad`` a forward-only
      fg_linear_logprobs);
    - ``model(..., fusedgrpo_head=fn)`` returns ``fn(hidden [B, S-1, H],
      weight [V, H], bias)``, the whole head as plain tensors in the dtype the
      head multiplies in (FusedGRPOTrainer's fused loss runs there);
    - ``model(..., fusedgrpo_hidden=True)`` returns ``(hidden, weight, bias)``
      for a loss computed after the forward returns, the head read outside
      its own forward: a DTensor weight (FSDP2) is gathered, its gradient
      averaged over the mesh; FSDP1's shard and any ZeRO-3 parameter are
      refused (fusedgrpo.sharded_weight.whole_head).

    Any other call is the model's own forward (generation is unchanged)."""
    scaling = _head_scaling(model)
    if scaling is not None:
        raise NotImplementedError(
            f"fusedgrpo: the model's LM head applies {scaling!r} to its logits; the fused head "
            "computes softmax(hidden . W^T + b) / temperature only")
    inner_forward = model.forward

    def logprobs(labels, weight, bias, hidden):
        hidden, weight, bias = _head_operands(hidden, weight, bias, cast_lm_head_to_fp32)
        labels = labels.to(weight.device)
        mask = labels != -100
        ctx = torch.autocast(hidden.device.type, enabled=False) if cast_lm_head_to_fp32 \
            else nullcontext()
        with ctx:
            logp, ent = _on_every_rank(linear_logprobs, hidden, weight, labels.clamp(min=0),
                                       mask, bias, temperature=temperature, return_entropy=True)
        return logp, ent, mask

    def in_place_of_head(fn, weight, bias, hidden):
        return fn(*_head_operands(hidden, weight, bias, cast_lm_head_to_fp32))

    @functools.wraps(type(model).forward)
    def _forward(self, *args, fused_lm_head=False, fusedgrpo_hidden=False, fusedgrpo_head=None,
                 labels=None, **kwargs):
        if not fused_lm_head and not fusedgrpo_hidden and fusedgrpo_head is None:
            if labels is not None:
                kwargs["labels"] = labels
            return inner_forward(*args, **kwargs)
        for k in ("shift_labels", "num_items_in_batch"):
            if kwargs.pop(k, None) is not None:
                raise NotImplementedError(f"fusedgrpo: {k} is not supported by the fused head")
        if kwargs.get("output_router_logits"):
            raise NotImplementedError("fusedgrpo: MoE router aux losses are not supported")
        kwargs["use_cache"] = False
        out = self.base_model(*args, **kwargs)
        hidden = out.last_hidden_state[:, :-1]
        # looked up per call: FSDP1 and PEFT replace the head after patching
        head = self.get_output_embeddings()
        if fusedgrpo_head is not None:
            return call_in_head(head, functools.partial(in_place_of_head, fusedgrpo_head), hidden)
        if fusedgrpo_hidden:
            weight, bias = whole_head(head.weight, head.bias, leaves_forward=True)
            return _head_operands(hidden, weight, bias, cast_lm_head_to_fp32)
        logp, ent, mask = call_in_head(head, functools.partial(logprobs, labels[:, 1:]), hidden)
        loss = -logp.sum() / mask.sum().clamp(min=1)
        return FusedCausalLMOutput(loss=loss, log_probs=logp, entropy=ent, label_mask=mask)

    model.forward = types.MethodType(_forward, model)


class FusedGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` with fusedgrpo's fused LM head and loss (module doc).

    Class attributes (set on an instance to change one trainer):
      fusedgrpo_impl: "fused" (default) or "materialized" (the plain baseline,
        whole [tokens, vocab] logits; for A/B comparisons);
      fusedgrpo_memory_budget: working-memory cap of the fused path in bytes
        (None: the library's default, 256 MiB on the CPU and 2 GiB of device
        memory on CUDA);
      fusedgrpo_threads: OpenMP threads of the C calls (None: OpenMP's default;
        on CUDA the host's share of a call only);
      fusedgrpo_filter_eps: gradient filtering of the fused loss (0: off, the
        default; "auto": the library's threshold for the dtype, off for float32;
        or a threshold in (0, 1]: docs/LOSS_SPEC.md "Gradient filtering").
        The "materialized" impl computes exact gradients and does not apply it.
    Each is checked (whatever the impl) when the trainer is constructed and
    again at every loss call (an instance may change them between): a bad
    value raises FusedGRPOError naming the attribute.
    """

    fusedgrpo_impl = "fused"
    fusedgrpo_memory_budget = None
    fusedgrpo_threads = None
    fusedgrpo_filter_eps = 0.0

    def __init__(self, *args, **kwargs):
        self._fusedgrpo_execution()  # before the model loads: a bad setting fails at once
        super().__init__(*args, **kwargs)
        if self.aux_loss_enabled:
            raise NotImplementedError("fusedgrpo: MoE router aux losses are not supported")
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        add_fusedgrpo_lm_head(base, temperature=self.temperature,
                              cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32)
        if self.ref_model is not None:
            add_fusedgrpo_lm_head(self.ref_model, temperature=self.temperature,
                                  cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32)

    # ------------------------------------------------------------ the loss
    def _fusedgrpo_execution(self) -> dict:
        """The fusedgrpo_* attributes as the C call's execution options, each
        checked for every impl (filter_eps too, which only the fused impl
        applies: the materialized one gets 0)."""
        impl = _lib.check_impl(self.fusedgrpo_impl, "fusedgrpo_impl")
        filter_eps = _lib.filter_eps_value(self.fusedgrpo_filter_eps, "fusedgrpo_filter_eps")
        _options.make_exec(self.fusedgrpo_threads, self.fusedgrpo_memory_budget)
        return dict(impl=impl, memory_budget=self.fusedgrpo_memory_budget,
                    threads=self.fusedgrpo_threads,
                    filter_eps=filter_eps if impl == "fused" else 0.0)

    def _fused_loss(self, *args, **options):
        """fusedgrpo.torch's loss with this trainer's execution options (checked
        here, inside the call that _on_every_rank agrees on)."""
        return fused_linear_grpo_loss(*args, **self._fusedgrpo_execution(), **options)

    def _head_loss(self, C, tensors, cfg, hidden, weight, bias):
        """The fused loss of the completions' hidden states, in the LM head's
        place; on every rank's agreement (_on_every_rank)."""
        ids, mask, advantages, old, ref, is_ratio, sampling = tensors
        with torch.autocast(hidden.device.type, enabled=False):
            loss, metrics, logp, ent = _on_every_rank(
                self._fused_loss, hidden[:, -C:], weight, ids, mask, advantages, bias, old, ref,
                is_ratio, sampling, **cfg)
        # The metrics are views of one tensor; FSDP2 warns of views among a
        # module's outputs (an in-place op on one would drop its backward hook).
        return loss, {k: v.clone() for k, v in metrics.items()}, logp, ent

    def _loss_config(self, inputs, mode):
        """The C call's options for this micro-batch and the scale of its loss,
        reproducing TRL's normalisation (docs/LOSS_SPEC.md "Aggregation")."""
        args = self.args
        ga = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        if self._entropy_bonus_enabled:
            if self.use_adaptive_entropy:
                coef = self.entropy_coef if self._last_world_entropy <= args.entropy_target else 0.0
            else:
                coef = self.entropy_coef
        else:
            coef = 0.0
        cfg = dict(loss_type=self.loss_type, importance_sampling_level=self.importance_sampling_level,
                   beta=self.beta, epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high,
                   delta=args.delta, temperature=self.temperature,
                   max_completion_length=self.max_completion_length,
                   sapo_temperature_pos=args.sapo_temperature_pos,
                   sapo_temperature_neg=args.sapo_temperature_neg,
                   use_bias_correction_kl=bool(args.use_bias_correction_kl),
                   vespo_k_pos=args.vespo_k_pos, vespo_lambda_pos=args.vespo_lambda_pos,
                   vespo_k_neg=args.vespo_k_neg, vespo_lambda_neg=args.vespo_lambda_neg,
                   off_policy_mask_threshold=self.off_policy_mask_threshold,
                   top_entropy_quantile=self.top_entropy_quantile)
        # TRL divides the policy term by the accumulation steps, except where it
        # is normalised by num_items_in_batch, which TRL rescales instead
        if _options.NORMALISER[self.loss_type] != "num_items_in_batch":
            cfg["entropy_coef"] = coef
            return cfg, 1.0 / ga
        # dapo, cispo, vespo: num_items_in_batch spans the generation batch
        items = float(inputs["num_items_in_batch"].clamp(min=1.0)) / self.accelerator.num_processes
        if mode == "train":
            items = items * ga / args.steps_per_generation
        cfg["num_items_in_batch"] = items
        cfg["entropy_coef"] = coef / ga
        return cfg, 1.0

    def _compute_loss(self, model, inputs):
        for k in ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes",
                  "token_type_ids", "mm_token_type_ids"):
            if inputs.get(k) is not None:
                raise NotImplementedError(f"fusedgrpo: multimodal input {k!r} is not supported")
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        C = completion_ids.size(1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        advantages = inputs["advantages"]
        if advantages.dim() == 2 and advantages.size(1) != 1:
            raise NotImplementedError("fusedgrpo: per-token advantages [B, T] are not supported")
        advantages = advantages.reshape(-1)
        mode = "train" if self.model.training else "eval"

        is_ratio = None
        if self.loss_type == "vespo":
            is_ratio = inputs.get("importance_sampling_ratio")
        elif self.use_vllm and self.vllm_importance_sampling_correction:
            is_ratio = inputs["importance_sampling_ratio"]
        cfg, scale = self._loss_config(inputs, mode)
        tensors = (completion_ids, mask, advantages, inputs.get("old_per_token_logps"),
                   inputs.get("ref_per_token_logps") if self.beta != 0.0 else None, is_ratio,
                   inputs.get("sampling_per_token_logps")
                   if self.off_policy_mask_threshold is not None else None)
        # The loss runs as the LM head's forward (add_fusedgrpo_lm_head): FSDP
        # and ZeRO-3 gather the head for it and reduce its gradient.
        with self.accelerator.autocast():
            loss, metrics, logp, entropies = model(
                input_ids=input_ids, attention_mask=attention_mask,
                fusedgrpo_head=functools.partial(self._head_loss, C, tensors, cfg))
        loss = loss * scale if scale != 1.0 else loss
        self._log_metrics(mode, metrics, entropies, mask)
        return loss

    # ------------------------------------------------------------ metrics
    def _log_metrics(self, mode, metrics, entropies, mask):
        """TRL's metrics from the C call's, reduced across processes as TRL
        reduces its own (sums and counts; nanmin / nanmax of the per-sequence
        extremes)."""
        m = self._metrics[mode]
        acc = self.accelerator
        mask_f = mask.float()
        tokens = mask_f.sum()
        seqs = torch.tensor(float(mask.size(0)), device=tokens.device)
        seq_level = self.importance_sampling_level == "sequence"

        def global_mean(value, count):
            totals = acc.reduce(torch.stack([value.to(count.device) * count, count]), reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        if self._entropy_bonus_enabled:
            m["policy_loss"].append(acc.gather(metrics["policy_loss"].detach()).nanmean().item())
            if self.use_adaptive_entropy and mode == "train":
                eff = mask_f
                if self.top_entropy_quantile < 1.0:
                    eff = mask_f * self.get_high_entropy_mask(entropies.detach(), mask,
                                                              1 - self.top_entropy_quantile)
                stats = torch.stack([(entropies.detach() * eff).sum(), eff.sum()])
                self._entropy_window_stats = stats if self._entropy_window_stats is None \
                    else self._entropy_window_stats + stats
                if acc.sync_gradients:
                    w = acc.reduce(self._entropy_window_stats, reduction="sum")
                    world_entropy = (w[0] / w[1].clamp(min=1.0)).item()
                    a = self.args
                    if world_entropy <= a.entropy_target:
                        self.entropy_coef = min(self.entropy_coef + a.entropy_coef_delta,
                                                a.entropy_coef_max)
                    else:
                        self.entropy_coef = max(self.entropy_coef - a.entropy_coef_delta,
                                                a.entropy_coef_min)
                    self._last_world_entropy = world_entropy
                    self._entropy_window_stats = None
            if mode == "train" and acc.sync_gradients:
                m["entropy_coef"].append(self.entropy_coef)
        if self.beta != 0.0:
            m["kl"].append(global_mean(metrics["kl"], tokens))
        m["entropy"].append(global_mean(metrics["entropy"], tokens))
        count = seqs if seq_level else tokens
        if self.loss_type in _CLIPPED:
            m["clip_ratio/low_mean"].append(global_mean(metrics["clip_ratio_low"], count))
            m["clip_ratio/high_mean"].append(global_mean(metrics["clip_ratio_high"], count))
            m["clip_ratio/region_mean"].append(global_mean(metrics["clip_ratio_region"], count))
            m["clip_ratio/low_min"].append(
                nanmin(acc.gather(metrics["clip_ratio_low_min"].reshape(1))).item())
            m["clip_ratio/high_max"].append(
                nanmax(acc.gather(metrics["clip_ratio_high_max"].reshape(1))).item())
        elif self.loss_type == "cispo":
            m["cispo_clip_ratio"].append(global_mean(metrics["cispo_clip_ratio"], count))
        elif self.loss_type == "vespo":
            m["vespo/phi_seq_mean"].append(global_mean(metrics["vespo_phi_seq_mean"], seqs))


_ = trl  # the version is checked by the parity test (TRL 1.16)
