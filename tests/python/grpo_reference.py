"""A float64 NumPy implementation of LOSS_SPEC.md (TRL's GRPOTrainer formulas),
written from the spec, independent of the C library's code.

The per-token loss is written as a plain function of the log-probs and the
entropies; its derivatives d loss / d logp and d loss / d entropy are taken by
central differences in float64 (so no hand-derived policy-loss gradient is
shared with the C code), and then chained through the softmax with the spec's
closed forms. Stop-gradient quantities (the on-policy `old`, CISPO's clipped
coefficient) are frozen at the base point, exactly what stop_gradient means.
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
                    use_bias_correction_kl=False, entropy_coef=0.0)

    def __init__(self, **kw):
        unknown = set(kw) - set(self.DEFAULTS)
        assert not unknown, unknown
        super().__init__({**self.DEFAULTS, **kw})

    def __getattr__(self, k):
        return self[k]


def loss_of(logp, ent, *, base_logp, mask, adv, old_logp, ref_logp, is_ratio, cfg):
    """(loss, per-token parts) as a function of logp [B, T] and entropy [B, T]."""
    m = mask.astype(np.float64)
    B, T = m.shape
    A = adv.astype(np.float64)[:, None]
    old = base_logp if old_logp is None else old_logp.astype(np.float64)
    eh = cfg.epsilon_low if cfg.epsilon_high is None else cfg.epsilon_high
    el = cfg.epsilon_low
    cnt = m.sum(1)
    tok_log_ratio = logp - old
    if cfg.importance_sampling_level == "token":
        log_ratio = tok_log_ratio
    else:
        lr = (m * tok_log_ratio).sum(1) / np.maximum(cnt, 1.0)
        log_ratio = np.repeat(lr[:, None], T, 1)
    ratio = np.exp(np.where(m > 0, log_ratio, 0.0))
    lt = cfg.loss_type
    if lt in PPO_TYPES:
        rt = np.minimum(ratio, cfg.delta) if cfg.delta is not None else ratio
        c = np.clip(ratio, 1 - el, 1 + eh)
        L = -np.minimum(rt * A, c * A)
    elif lt == "cispo":
        # stop_gradient(min(ratio, eps_high)): the coefficient at the base point
        if cfg.importance_sampling_level == "token":
            base_ratio = np.exp(np.where(m > 0, base_logp - old, 0.0))
        else:
            lr0 = (m * (base_logp - old)).sum(1) / np.maximum(cnt, 1.0)
            base_ratio = np.repeat(np.exp(lr0)[:, None], T, 1)
        L = -np.minimum(base_ratio, eh) * A * logp
    elif lt == "sapo":
        tau = np.where(A > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
        L = -(4.0 / tau) * _sigmoid(tau * (ratio - 1.0)) * A
    else:
        raise ValueError(lt)
    if is_ratio is not None:
        isr = np.asarray(is_ratio, np.float64)
        L = L * (isr.reshape(B, 1) if isr.size == B and isr.shape != (B, T) else isr)
    kl = np.zeros_like(L)
    if cfg.beta != 0:
        d = np.where(m > 0, ref_logp.astype(np.float64) - logp, 0.0)
        kl = np.exp(d) - d - 1.0
        if cfg.use_bias_correction_kl:
            kl = kl * np.exp(np.where(m > 0, tok_log_ratio, 0.0))  # the token-level ratio
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
        if lt in ("dapo", "cispo"):
            items = tot if cfg.num_items_in_batch is None else cfg.num_items_in_batch
            return (m * per_token).sum() / max(items, 1.0)
        return np.mean((m * per_token).sum(1))  # luspo

    entropy_term = cfg.entropy_coef * (m * ent).sum() / tot
    loss = reduce(L) - entropy_term
    # The loss with every term's magnitude: the scale a float32 sum of these
    # terms is accurate to (the loss itself may nearly cancel).
    magnitude = reduce(np.abs(L)) + abs(entropy_term)
    return loss, dict(ratio=ratio, kl=kl, magnitude=magnitude)


def reference(hidden, weight, token_ids, mask, advantages, old_logp=None, ref_logp=None, *,
              bias=None, is_ratio=None, fd_step=1e-6, **kw):
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

    args = dict(base_logp=logp, mask=m, adv=np.asarray(advantages), old_logp=old_logp,
                ref_logp=ref_logp, is_ratio=is_ratio, cfg=cfg)
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

    # metrics
    tot = max(m.sum(), 1.0)
    ratio = parts["ratio"]
    A = np.asarray(advantages, np.float64)[:, None]
    eh = cfg.epsilon_low if cfg.epsilon_high is None else cfg.epsilon_high
    low = (ratio < 1 - cfg.epsilon_low) & (A < 0) & m
    high = (ratio > 1 + eh) & (A > 0) & m
    metrics = dict(
        kl=float((parts["kl"] * m).sum() / tot) if cfg.beta != 0 else 0.0,
        entropy=float((ent * m).sum() / tot),
        clip_ratio_low=float(low.sum() / tot),
        clip_ratio_high=float(high.sum() / tot),
        clip_ratio_region=float((low | high).sum() / tot),
        cispo_clip_ratio=float(((ratio > eh) & m).sum() / tot) if cfg.loss_type == "cispo"
        else 0.0,
    )
    return dict(loss=float(loss), loss_scale=float(parts["magnitude"]), logp=logp, entropy=ent,
                metrics=metrics, grad_hidden=grad_hidden, grad_weight=grad_weight,
                grad_bias=grad_bias, grad_logits=dlogits, dlogp=g)
