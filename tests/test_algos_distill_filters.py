"""Distillation divergences (hand values, torch reference, top-k renormalisation) and sampling filters."""

import math

import pytest
import torch
import torch.nn.functional as F

import posttrain.algos as A


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=tol, rtol=tol)


def _two_token():
    teacher = torch.tensor([[[0.0, 0.0]]])  # P = (.5, .5)
    student = torch.tensor([[[math.log(3.0), 0.0]]])  # Q = (.75, .25)
    return student, teacher, torch.ones(1, 1)


def test_hand_values_two_token_vocab():
    s, t, m = _two_token()
    fkl, met = A.distill_losses.get("forward_kl")(s, m, teacher_logits=t)
    close(fkl, [[0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)]])
    rkl, _ = A.distill_losses.get("reverse_kl")(s, m, teacher_logits=t)
    close(rkl, [[0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)]])
    jsd, _ = A.distill_losses.get("jsd")(s, m, teacher_logits=t, beta=0.5)
    M = (0.625, 0.375)
    kl_pm = 0.5 * math.log(0.5 / M[0]) + 0.5 * math.log(0.5 / M[1])
    kl_qm = 0.75 * math.log(0.75 / M[0]) + 0.25 * math.log(0.25 / M[1])
    close(jsd, [[0.5 * kl_pm + 0.5 * kl_qm]])
    jsd2, _ = A.distill_losses.get("jsd")(s, m, teacher_logits=t, beta=0.2)
    M2 = (0.2 * 0.5 + 0.8 * 0.75, 0.2 * 0.5 + 0.8 * 0.25)
    kl_pm2 = 0.5 * math.log(0.5 / M2[0]) + 0.5 * math.log(0.5 / M2[1])
    kl_qm2 = 0.75 * math.log(0.75 / M2[0]) + 0.25 * math.log(0.25 / M2[1])
    close(jsd2, [[0.2 * kl_pm2 + 0.8 * kl_qm2]])
    _, met2 = A.distill_losses.get("forward_kl")(s, m, teacher_logits=torch.tensor([[[0.0, 1.0]]]))
    close(met2["distill/top1_agree"], 0.0)  # teacher argmax 1, student argmax 0
    close(met["distill/loss"], fkl.mean())


def test_against_torch_kl_div_and_masking():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 3, 11, generator=g, requires_grad=True)
    t = torch.randn(2, 3, 11, generator=g)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    ls, lt = F.log_softmax(s / 2.0, -1), F.log_softmax(t / 2.0, -1)
    fkl, _ = A.distill_losses.get("forward_kl")(s, mask, teacher_logits=t, temperature=2.0)
    close(fkl, F.kl_div(ls, lt, log_target=True, reduction="none").sum(-1) * mask)
    rkl, _ = A.distill_losses.get("reverse_kl")(s, mask, teacher_logits=t, temperature=2.0)
    close(rkl, F.kl_div(lt, ls, log_target=True, reduction="none").sum(-1) * mask)
    jsd, _ = A.distill_losses.get("jsd")(s, mask, teacher_logits=t, temperature=2.0)
    assert (jsd[mask.bool()] > 0).all() and (jsd[mask.bool()] <= math.log(2) + 1e-6).all()  # JSD(½) ≤ log 2
    A.aggregate(fkl, mask, "token_mean").backward()
    assert s.grad[0, 2].abs().sum() == 0 and s.grad[0, 0].abs().sum() > 0


@pytest.mark.parametrize("name", ["forward_kl", "reverse_kl", "jsd"])
def test_zero_iff_equal(name):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 7, generator=g)
    loss, _ = A.distill_losses.get(name)(logits, torch.ones(2, 4), teacher_logits=logits.clone())
    close(loss, torch.zeros(2, 4))
    loss2, _ = A.distill_losses.get(name)(logits + torch.randn(2, 4, 7, generator=g), torch.ones(2, 4),
                                          teacher_logits=logits)
    assert (loss2 > 1e-4).all()


@pytest.mark.parametrize("name", ["forward_kl", "reverse_kl", "jsd"])
def test_topk_renormalised_support(name):
    g = torch.Generator().manual_seed(2)
    V, k = 10, 4
    s = torch.randn(1, 3, V, generator=g)
    t = torch.randn(1, 3, V, generator=g)
    mask = torch.ones(1, 3)
    t_logp = F.log_softmax(t, -1)
    top_lp, top_ids = t_logp.topk(k, -1)
    loss, _ = A.distill_losses.get(name)(s, mask, teacher_topk_logps=top_lp, teacher_topk_ids=top_ids)
    # expected: both distributions restricted to the teacher's top-k and renormalised there
    p = t_logp.exp().gather(-1, top_ids)
    p = p / p.sum(-1, keepdim=True)
    q = F.softmax(s, -1).gather(-1, top_ids)
    q = q / q.sum(-1, keepdim=True)
    ref, _ = A.distill_losses.get(name)(q.log(), mask, teacher_logits=p.log())  # full loss on a k-token vocab
    close(loss, ref)
    # k = V (any order) equals the full-vocabulary loss
    all_lp, all_ids = t_logp.topk(V, -1)
    full, _ = A.distill_losses.get(name)(s, mask, teacher_logits=t)
    close(A.distill_losses.get(name)(s, mask, teacher_topk_logps=all_lp, teacher_topk_ids=all_ids)[0], full)


def test_distill_errors():
    s = torch.zeros(1, 1, 5)
    with pytest.raises(ValueError, match="same tokenizer"):
        A.distill_losses.get("forward_kl")(s, torch.ones(1, 1), teacher_logits=torch.zeros(1, 1, 6))
    with pytest.raises(ValueError, match="teacher_logits"):
        A.distill_losses.get("forward_kl")(s, torch.ones(1, 1))
    with pytest.raises(ValueError, match="0 < beta < 1"):
        A.distill_losses.get("jsd")(s, torch.ones(1, 1), teacher_logits=s, beta=1.0)


R = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 0])
G = torch.tensor([7, 7, 7, 7, 3, 3, 3, 3, 5, 5, 5, 5])


def test_dynamic_sampling_drops_all_equal_groups():
    res = A.dynamic_sampling(R, G)
    assert res.indices.tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert res.kept_groups.tolist() == [5, 7]
    assert res.num_groups.item() == 3 and res.num_kept.item() == 2
    res0 = A.dynamic_sampling(torch.zeros(4), torch.tensor([0, 0, 1, 1]))
    assert res0.indices.numel() == 0 and res0.num_kept.item() == 0


def test_learnability_band():
    res = A.learnability_band(R, G)  # p: group 7 .5, group 3 1.0, group 5 .25
    assert res.kept_groups.tolist() == [5, 7]
    res = A.learnability_band(R, G, low=0.3)
    assert res.kept_groups.tolist() == [7] and res.indices.tolist() == [0, 1, 2, 3]
    assert A.in_band(torch.tensor([0.0, 0.2, 0.21, 0.5, 0.79, 0.8, 1.0])).tolist() == [
        False, False, True, True, True, False, False]
    with pytest.raises(ValueError):
        A.in_band(torch.tensor([0.5]), low=0.8, high=0.2)


# ---------------------------------------------------------------- top-k with the tail bucket


def _coarse(probs, ids):
    """(P on S, P outside S) as a (…, k + 1) distribution."""
    on = probs.gather(-1, ids)
    return torch.cat([on, 1 - on.sum(-1, keepdim=True)], -1)


@pytest.mark.parametrize("name", ["forward_kl", "reverse_kl", "jsd"])
def test_topk_tail_bucket_is_the_divergence_of_the_coarsened_distributions(name):
    g = torch.Generator().manual_seed(3)
    V, k = 12, 3
    s = torch.randn(2, 3, V, generator=g, dtype=torch.float64)
    t = torch.randn(2, 3, V, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 3)
    t_logp = F.log_softmax(t, -1)
    top_lp, top_ids = t_logp.topk(k, -1)
    tail = torch.logsumexp(t_logp.scatter(-1, top_ids, float("-inf")), -1)
    loss, _ = A.distill_losses.get(name)(s, mask, teacher_topk_logps=top_lp, teacher_topk_ids=top_ids, teacher_tail_logp=tail)
    p_bar, q_bar = _coarse(t_logp.exp(), top_ids), _coarse(F.softmax(s, -1), top_ids)
    ref, _ = A.distill_losses.get(name)(q_bar.log(), mask, teacher_logits=p_bar.log())  # the full loss on k + 1 outcomes
    close(loss, ref.float())
    full, _ = A.distill_losses.get(name)(s, mask, teacher_logits=t)
    assert (loss <= full + 1e-6).all()  # data processing: coarsening never increases a divergence
    assert (loss > 0).all()


def test_topk_tail_hand_values_and_gradient_reaches_the_rest_of_the_vocabulary():
    # P = (.5, .3, .2), S = {0}: P̄ = (.5, .5); Q = (.2, .6, .2): Q̄ = (.2, .8)
    s = torch.tensor([[[0.2, 0.6, 0.2]]]).log().requires_grad_(True)
    top_lp, top_ids, tail = torch.tensor([[[math.log(0.5)]]]), torch.tensor([[[0]]]), torch.tensor([[math.log(0.5)]])
    fkl, _ = A.distill_losses.get("forward_kl")(s, torch.ones(1, 1), teacher_topk_logps=top_lp, teacher_topk_ids=top_ids,
                                                teacher_tail_logp=tail)
    close(fkl, [[0.5 * math.log(0.5 / 0.2) + 0.5 * math.log(0.5 / 0.8)]])
    fkl.sum().backward()
    assert s.grad[0, 0, 1] != 0  # the tail's share moves tokens outside S (renormalising on S would not)
    # k = V: the tail is empty (log 0 = -inf) and the loss is the full one, with finite gradients
    t = torch.tensor([[[0.1, 1.0, -0.5]]])
    lp, ids = F.log_softmax(t, -1).topk(3, -1)
    for name in ("forward_kl", "reverse_kl", "jsd"):
        x = s.detach().clone().requires_grad_(True)
        loss, _ = A.distill_losses.get(name)(x, torch.ones(1, 1), teacher_topk_logps=lp, teacher_topk_ids=ids,
                                             teacher_tail_logp=torch.tensor([[float("-inf")]]))
        close(loss, A.distill_losses.get(name)(x.detach(), torch.ones(1, 1), teacher_logits=t)[0])
        loss.sum().backward()
        assert torch.isfinite(x.grad).all()
