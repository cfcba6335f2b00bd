"""fusedgrpo.torch's gradients as autograd hands them out: first order only (a
double backward through any fused op raises, whatever else is in the graph)
and tensors of the caller's own (a retained graph backwarded any number of
times gives the same gradients however the caller edited the earlier ones)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fusedgrpo.torch as fgt  # noqa: E402
from grpo_reference import make_inputs  # noqa: E402


def _inputs(seed, B=3, T=5, H=7, V=11):
    inp = make_inputs(np.random.default_rng(seed), B=B, T=T, H=H, V=V)
    return {k: (torch.from_numpy(np.ascontiguousarray(v)) if v is not None else None)
            for k, v in inp.items()}


def _leaves(t):
    return tuple(t[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))


def _loss(t, h, w, b):
    loss, _, _, _ = fgt.fused_linear_grpo_loss(
        h, w, t["token_ids"], t["mask"], t["advantages"], b, t["old_logp"], t["ref_logp"],
        beta=0.05, loss_type="grpo", entropy_coef=0.01)
    return loss


def _module_loss(t, h, w, b):
    mod = fgt.FusedLinearGRPOLoss(beta=0.05, loss_type="dapo")
    loss, _ = mod(h, w, t["token_ids"], t["mask"], t["advantages"], b,
                  ref_per_token_logps=t["ref_logp"], old_per_token_logps=t["old_logp"])
    return loss


def _logprobs_loss(t, h, w, b):
    logp, ent = fgt.linear_logprobs(h, w, t["token_ids"], t["mask"], b, return_entropy=True)
    return (logp * t["advantages"][:, None]).sum() - 0.1 * ent.sum()


FUSED = {"loss": _loss, "module": _module_loss, "linear_logprobs": _logprobs_loss}


# ---------------------------------------------------------------- double backward

@pytest.mark.parametrize("op", FUSED)
def test_double_backward_raises_whatever_else_is_in_the_graph(op):
    """d/dh of (fused + sum h^2)'s gradient: the fused part's second-order term
    exists (its gradient depends on h) but is not computed, so the second
    backward must raise, not return the other term's 2 alone."""
    t = _inputs(1)
    f = FUSED[op]
    h, w, b = _leaves(t)
    f(t, h, w, b).backward()
    first = (h.grad, w.grad, b.grad)
    for wrt, extra in ((0, lambda h, w, b: (h ** 2).sum()),
                       (1, lambda h, w, b: (w ** 3).sum() + b.sum()),
                       (2, lambda h, w, b: 0.0)):
        h, w, b = _leaves(t)
        args = (h, w, b)
        g = torch.autograd.grad(f(t, h, w, b) + extra(h, w, b), args[wrt], create_graph=True)[0]
        # the first-order gradient under create_graph is the plain one
        if wrt == 2:
            assert torch.equal(g, first[2])
        with pytest.raises(RuntimeError, match="double backward through a fused op"):
            torch.autograd.grad(g.sum(), args[wrt])
    # a second derivative taken through the loss's own incoming gradient
    # (d(loss^2)/dh = 2 loss dloss/dh) reaches the op too
    h, w, b = _leaves(t)
    g = torch.autograd.grad(f(t, h, w, b) ** 2, h, create_graph=True)[0]
    with pytest.raises(RuntimeError, match="double backward through a fused op"):
        g.sum().backward()


def test_double_backward_raises_through_the_op():
    t = _inputs(2)
    h, w, b = _leaves(t)
    out = torch.ops.fusedgrpo.linear_grpo(h, w, t["token_ids"], t["mask"], t["advantages"], b,
                                          t["old_logp"], t["ref_logp"], beta=0.05)
    gw, = torch.autograd.grad(out[0] * 3.0, w, create_graph=True)
    assert torch.equal(gw, 3.0 * out[5].detach())
    with pytest.raises(RuntimeError, match="double backward through a fused op"):
        torch.autograd.grad((gw * gw).sum(), h)


def test_create_graph_without_a_second_backward_is_first_order_exact():
    t = _inputs(3)
    h, w, b = _leaves(t)
    _loss(t, h, w, b).backward()
    h2, w2, b2 = _leaves(t)
    grads = torch.autograd.grad(_loss(t, h2, w2, b2), (h2, w2, b2), create_graph=True)
    for got, want in zip(grads, (h.grad, w.grad, b.grad)):
        assert torch.equal(got, want)
        assert got.requires_grad  # attached to the node that refuses a second backward


# ---------------------------------------------------------------- retained graphs

@pytest.mark.parametrize("op", FUSED)
@pytest.mark.parametrize("scale", [1.0, 0.75])
def test_retained_graph_gives_the_same_gradients_however_they_were_edited(op, scale):
    t = _inputs(4)
    h, w, b = _leaves(t)
    loss = FUSED[op](t, h, w, b) * scale  # 1.0: loss.backward() sends exactly 1
    loss.backward(retain_graph=True)
    first = [x.grad.clone() for x in (h, w, b)]
    # edited in place, then dropped: the next backward is not affected
    w.grad.mul_(0.5)
    h.grad.add_(1.0)
    w.grad = None
    loss.backward(retain_graph=True)
    assert torch.equal(w.grad, first[1])
    assert torch.equal(h.grad, first[0] + 1.0 + first[0])
    # zeroed in place (zero_grad(set_to_none=False)), then a third backward
    for x in (h, w, b):
        x.grad.zero_()
    loss.backward(retain_graph=True)
    for x, g in zip((h, w, b), first):
        assert torch.equal(x.grad, g)
    # a fourth one accumulates
    loss.backward()
    for x, g in zip((h, w, b), first):
        assert torch.equal(x.grad, g + g)


@pytest.mark.parametrize("op", FUSED)
def test_autograd_grad_results_are_the_callers(op):
    t = _inputs(5)
    h, w, b = _leaves(t)
    loss = FUSED[op](t, h, w, b)
    a = torch.autograd.grad(loss, (h, w, b), retain_graph=True)
    want = [x.clone() for x in a]
    for x in a:
        x.mul_(-3.0)
    for _ in range(2):
        again = torch.autograd.grad(loss, (h, w, b), retain_graph=True)
        for x, y in zip(again, want):
            assert torch.equal(x, y)
    assert all(x.data_ptr() != y.data_ptr() for x, y in zip(a, again))


def test_unit_backward_that_frees_the_graph_hands_over_without_a_copy():
    """loss.backward() (incoming gradient 1, graph freed): the saved gradients
    become .grad as they are (grad_weight is V x H); the op's own outputs
    show it."""
    t = _inputs(6)
    h, w, b = _leaves(t)
    out = torch.ops.fusedgrpo.linear_grpo(h, w, t["token_ids"], t["mask"], t["advantages"], b,
                                          t["old_logp"], t["ref_logp"], beta=0.05)
    ptrs = [x.data_ptr() for x in out[4:]]
    out[0].backward()
    assert [x.grad.data_ptr() for x in (h, w, b)] == ptrs
    h2, w2, b2 = _leaves(t)
    out = torch.ops.fusedgrpo.linear_grpo(h2, w2, t["token_ids"], t["mask"], t["advantages"], b2,
                                          t["old_logp"], t["ref_logp"], beta=0.05)
    out[0].backward(retain_graph=True)  # kept: copies
    assert all(x.grad.data_ptr() != p for x, p in zip((h2, w2, b2), (o.data_ptr()
                                                                     for o in out[4:])))
    for x, y in zip((h, w, b), (h2, w2, b2)):
        assert torch.equal(x.grad, y.grad)
