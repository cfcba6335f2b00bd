"""A float64 NumPy implementation of docs/LOSS_SPEC.md (TRL 1.16's GRPOTrainer formulas),
written from the spec, independent of the C library's code.

The per-token loss is written as a plain function of the log-probs and the
entropies; its derivatives d loss / d logp and d loss / d entropy are taken by
central differences in float64 (so no hand-derived policy-loss gradient is
shared with the C code), and then chained through the softmax with the spec's
closed forms. Stop-gradient quantities (the on-policy `old`, CISPO's clipped
coefficient, VESPO's gamma weight, the off-policy and high-entropy masks) are
frozen at the base point, exactly what stop_gradient means.
"""
from __future__ import annotations

import numpy as np

PPO_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def make_inputs(rng, B=3, T=5, H=16, V=31, *, bias=True, off_policy=True, ref=True,
                all_masked_row=None, scale=1.0, bad_masked_ids=True):
    """Random inputs; masked positions hold out-of-range token ids (never read)."""
    hidden = (rng.standard_normal((B, T, H)) * scale).astype(np.float32)
    weight = (rng.standard_normal((V, H)) / np.sqrt(H) * 2.0).astype(np.float32)
    b = (rng.standard_normal(V) * 0.3).astype(np.float32) if bias else None
    tok = rng.integers(0, V, size=(B, T)).astype(np.int64)
    mask = np.ones((B, T), dtype=bool)
    for i in range(B):
        n = rng.integers(1, T + 1)
        mask[i, n:] = False
    if all_masked_row is not None:
        mask[all_masked_row] = False
    if bad_masked_ids:
        tok[~mask] = V + 1000
    adv = rng.standard_normal(B).astype(np.float32)
    if B > 1:
        adv[0] = abs(adv[0]) + 0.1
        adv[1] = -abs(adv[1]) - 0.1
    inp = dict(hidden=hidden, weight=weight, bias=b, token_ids=tok, mask=mask, advantages=adv)
    # Log-probs near the policy's own, so ratios straddle the clip range.
    lp = log_softmax_rows(hidden.astype(np.float64) @ weight.astype(np.float64).T
                          + (0 if b is None else b.astype(np.float64)))
    cur = np.take_along_axis(lp, np.clip(tok, 0, V - 1)[..., None], -1)[..., 0]
    if off_policy:
        inp["old_logp"] = (cur + rng.normal(0, 0.35, (B, T))).astype(np.float32)
    if ref:
        inp["ref_logp"] = (cur + rng.normal(0, 0.3, (B, T))).astype(np.float32)
    return inp


def log_softmax_rows(z):
    mx = z.max(-1, keepdims=True)
    return z - mx - np.log(np.exp(z - mx).sum(-1, keepdims=True))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


class Config(dict):
    DEFAULTS = dict(beta=0.0, epsilon_low=0.2, epsilon_high=None, delta=None, temperature=1.0,
                    loss_type="dapo", importance_sampling_level="token",
                    max_completion_length=None, num_items_in_batch=None,
                    sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
                    use_bias_correction_kl=False, entropy_coef=0.0,
                    vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0,
                    off_policy_mask_threshold=None, top_entropy_quantile=1.0)

    def __init__(self, **kw):
        unknown = set(kw) - set(self.DEFAULTS)
        assert not unknown, unknown
        super().__init__({**self.DEFAULTS, **kw})

    def __getattr__(self, k):
        return self[k]


def entropy_threshold(ent, m, q):
    """TRL's get_high_entropy_mask threshold: the (1 - q) quantile (linear
    interpolation) of the unmasked entropies; +inf when none."""
    vals = np.sort(ent[m > 0])
    if vals.size == 0:
        return np.inf
    return float(np.quantile(vals, 1.0 - q))


def loss_of(logp, ent, *, base_logp, base_ent, mask, adv, old_logp, ref_logp, is_ratio,
            sampling_logp, cfg):
    """(loss, per-token parts) as a function of logp [B, T] and entropy [B, T];
    base_logp / base_ent are the detached values (stop_gradient)."""
    m = mask.astype(np.float64)
    B, T = m.shape
    A = adv.astype(np.float64)[:, None]
    old = base_logp if old_logp is None else old_logp.astype(np.float64)
    eh = cfg.epsilon_low if cfg.epsilon_high is None else cfg.epsilon_high
    el = cfg.epsilon_low
    cnt = m.sum(1)
    tok_log_ratio = np.where(m > 0, logp - old, 0.0)
    seq = cfg.importance_sampling_level == "sequence"
    if not seq:
        log_ratio = tok_log_ratio
    else:
        lr = (m * tok_log_ratio).sum(1) / np.maximum(cnt, 1.0)
        log_ratio = np.repeat(lr[:, None], T, 1)
    ratio = np.exp(log_ratio)
    isr = None
    if is_ratio is not None:
        isr = np.asarray(is_ratio, np.float64)
        isr = isr.reshape(B, 1) if isr.size == B and isr.shape != (B, T) else np.where(m > 0, isr, 1.0)
    lt = cfg.loss_type
    phi = np.ones((B, 1))
    if lt in PPO_TYPES:
        c = np.clip(ratio, 1 - el, 1 + eh)
        rt = np.minimum(ratio, cfg.delta) if cfg.delta is not None else ratio
        L = -np.minimum(rt * A, c * A)
    elif lt == "cispo":
        # stop_gradient(min(ratio, eps_high)): the coefficient at the base point
        base_tok = np.where(m > 0, base_logp - old, 0.0)
        if not seq:
            base_ratio = np.exp(base_tok)
        else:
            base_ratio = np.repeat(np.exp((m * base_tok).sum(1) / np.maximum(cnt, 1.0))[:, None], T, 1)
        L = -np.minimum(base_ratio, eh) * A * logp
    elif lt == "sapo":
        tau = np.where(A > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
        L = -(4.0 / tau) * _sigmoid(tau * (ratio - 1.0)) * A
    elif lt == "vespo":
        # TRL's get_gamma_weights, detached: phi(w) = exp(lam + k log w - lam w)
        lo = np.log(1e-8)
        slr = (np.clip(np.where(m > 0, base_logp - old, 0.0), -20, 20) * m).sum(1, keepdims=True)
        if isr is not None:
            slr = slr + np.clip(np.log(isr), lo, 20).sum(1, keepdims=True)
        logw = np.clip(slr, lo, 20)
        k = np.where(A >= 0, cfg.vespo_k_pos, cfg.vespo_k_neg)
        lam = np.maximum(np.where(A >= 0, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg), 1e-4)
        with np.errstate(over="ignore", invalid="ignore"):
            phi = np.exp(lam + k * logw - lam * np.exp(logw))
        phi = np.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)
        L = -phi * A * logp
    else:
        raise ValueError(lt)
    if cfg.off_policy_mask_threshold is not None:  # TRL's get_off_policy_mask
        samp = old if sampling_logp is None else np.asarray(sampling_logp, np.float64)
        kl_div = np.nan_to_num(samp - base_logp, nan=0.0)
        avg = (kl_div * m).sum(1, keepdims=True) / np.maximum(cnt, 1.0)[:, None]
        L = L * ((A >= 0) | (avg <= cfg.off_policy_mask_threshold))
    ent_mask = np.ones((B, T), dtype=bool)
    if cfg.top_entropy_quantile < 1.0:
        ent_mask = (base_ent * m >= entropy_threshold(base_ent, m, cfg.top_entropy_quantile)) & (m > 0)
        L = L * ent_mask
    if isr is not None and lt != "vespo":
        L = L * isr
    kl = np.zeros((B, T))
    if cfg.beta != 0:
        d = np.where(m > 0, ref_logp.astype(np.float64) - logp, 0.0)
        kl = np.exp(d) - d - 1.0
        if cfg.use_bias_correction_kl:
            kl = kl * ratio  # TRL's coef_1: the ratio of the importance-sampling level
        L = L + cfg.beta * kl
    L = np.where(m > 0, L, 0.0)
    tot = max(m.sum(), 1.0)

    def reduce(per_token):
        if lt in ("grpo", "sapo"):
            return np.mean((m * per_token).sum(1) / np.maximum(cnt, 1.0))
        if lt == "bnpo":
            return (m * per_token).sum() / tot
        if lt == "dr_grpo":
            mcl = T if cfg.max_completion_length is None else cfg.max_completion_length
            return (m * per_token).sum() / (B * mcl)
        if lt in ("dapo", "cispo", "vespo"):
            items = tot if cfg.num_items_in_batch is None else cfg.num_items_in_batch
            return (m * per_token).sum() / max(items, 1.0)
        return np.mean((m * per_token).sum(1))  # luspo

    eff = m * ent_mask
    entropy_term = cfg.entropy_coef * (eff * ent).sum() / max(eff.sum(), 1.0)
    policy = reduce(L)
    loss = policy - entropy_term
    # The loss with every term's magnitude: the scale a float32 sum of these
    # terms is accurate to (the loss itself may nearly cancel).
    magnitude = reduce(np.abs(L)) + abs(entropy_term)
    return loss, dict(ratio=ratio, kl=kl, magnitude=magnitude, phi=phi, policy=policy)


def reference(hidden, weight, token_ids, mask, advantages, old_logp=None, ref_logp=None, *,
              bias=None, is_ratio=None, sampling_logp=None, fd_step=1e-6, **kw):
    """Loss, metrics, logp, entropy and the three gradients, in float64.
    loss_scale: the loss of the terms' magnitudes, what its error is relative to."""
    cfg = Config(**kw)
    h = np.asarray(hidden, np.float64)
    W = np.asarray(weight, np.float64)
    B, T, H = h.shape
    V = W.shape[0]
    m = np.asarray(mask).astype(bool)
    tok = np.where(m, np.asarray(token_ids), 0)
    z = h @ W.T
    if bias is not None:
        z = z + np.asarray(bias, np.float64)
    z = z / cfg.temperature
    lsm = log_softmax_rows(z)
    p = np.exp(lsm)
    logp = np.take_along_axis(lsm, tok[..., None], -1)[..., 0]
    ent = -(p * lsm).sum(-1)
    logp = np.where(m, logp, 0.0)
    ent = np.where(m, ent, 0.0)

    args = dict(base_logp=logp, base_ent=ent, mask=m, adv=np.asarray(advantages),
                old_logp=old_logp, ref_logp=ref_logp, is_ratio=is_ratio,
                sampling_logp=sampling_logp, cfg=cfg)
    loss, parts = loss_of(logp, ent, **args)

    # d loss / d logp and d loss / d entropy by central differences (float64)
    g = np.zeros((B, T))
    e = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            if not m[b, t]:
                continue
            for arr, out, which in ((logp, g, 0), (ent, e, 1)):
                if which == 1 and cfg.entropy_coef == 0:
                    continue
                xp = arr.copy()
                xm = arr.copy()
                xp[b, t] += fd_step
                xm[b, t] -= fd_step
                if which == 0:
                    lp_, lm_ = loss_of(xp, ent, **args)[0], loss_of(xm, ent, **args)[0]
                else:
                    lp_, lm_ = loss_of(logp, xp, **args)[0], loss_of(logp, xm, **args)[0]
                out[b, t] = (lp_ - lm_) / (2 * fd_step)

    onehot = np.zeros_like(p)
    np.put_along_axis(onehot, tok[..., None], 1.0, -1)
    dz = g[..., None] * (onehot - p) - e[..., None] * p * (lsm + ent[..., None])
    dz = np.where(m[..., None], dz, 0.0)
    dlogits = dz / cfg.temperature
    grad_hidden = dlogits @ W
    flat = dlogits.reshape(B * T, V)
    grad_weight = flat.T @ h.reshape(B * T, H)
    grad_bias = flat.sum(0) if bias is not None else None

    # metrics: TRL 1.16's (global_masked_mean, masked_seq_mean with nanmin / nanmax)
    tot = max(m.sum(), 1.0)
    ratio = parts["ratio"]
    A = np.asarray(advantages, np.float64)[:, None]
    eh = cfg.epsilon_low if cfg.epsilon_high is None else cfg.epsilon_high
    seq = cfg.importance_sampling_level == "sequence"
    r = ratio[:, :1] if seq else ratio
    if cfg.delta is not None and cfg.loss_type in PPO_TYPES:  # TRL's coef_1 after the clamp
        r = np.minimum(r, cfg.delta)
    low = (r < 1 - cfg.epsilon_low) & (A < 0)
    high = (r > 1 + eh) & (A > 0)
    cisp = (r > eh) & (A > 0)
    mm = m.astype(np.float64)

    def gmean(x):
        return float(x.mean()) if seq else float((x * mm).sum() / tot)

    def seqmean(x):
        if seq:
            return x[:, 0].astype(np.float64)
        with np.errstate(invalid="ignore"):
            return (x * mm).sum(1) / mm.sum(1)

    def nan_reduce(f, x):
        x = x[~np.isnan(x)]
        return float(f(x)) if x.size else float("nan")

    clipped = cfg.loss_type in PPO_TYPES
    metrics = dict(
        kl=float((parts["kl"] * m).sum() / tot) if cfg.beta != 0 else 0.0,
        entropy=float((ent * m).sum() / tot),
        clip_ratio_low=gmean(low) if clipped else 0.0,
        clip_ratio_high=gmean(high) if clipped else 0.0,
        clip_ratio_region=gmean(low | high) if clipped else 0.0,
        cispo_clip_ratio=gmean(cisp) if cfg.loss_type == "cispo" else 0.0,
        clip_ratio_low_min=nan_reduce(np.min, seqmean(low)) if clipped else 0.0,
        clip_ratio_high_max=nan_reduce(np.max, seqmean(high)) if clipped else 0.0,
        vespo_phi_seq_mean=float(parts["phi"].mean()) if cfg.loss_type == "vespo" else 0.0,
        policy_loss=float(parts["policy"]),
    )
    return dict(loss=float(loss), loss_scale=float(parts["magnitude"]), logp=logp, entropy=ent,
                metrics=metrics, grad_hidden=grad_hidden, grad_weight=grad_weight,
                grad_bias=grad_bias, grad_logits=dlogits, dlogp=g)
