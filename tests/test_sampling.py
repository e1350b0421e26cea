"""posttrain.ops.sampling: exact semantics on hand-made logits, distribution (chi-square), reproducibility."""

import math

import pytest
import torch

from posttrain.ops.sampling import (
    counter_uniforms,
    kept_logprobs,
    process_logits,
    sample,
    sample_logits,
    trainer_logprobs,
)

CHI2_999 = {3: 16.27, 4: 18.47, 5: 20.52, 7: 24.32}  # chi-square critical values at p = 0.001


def probs(lp):
    return lp.exp()


def test_temperature_only():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    lp = process_logits(logits, temperature=0.5)
    expect = torch.log_softmax(torch.tensor([[2.0, 4.0, 6.0]]), -1)
    assert torch.allclose(lp, expect, atol=1e-6)


def test_top_k_keeps_ties_at_kth_value():
    logits = torch.tensor([[4.0, 3.0, 3.0, 1.0]])
    lp = process_logits(logits, top_k=2)
    assert torch.isinf(lp[0, 3]) and torch.isfinite(lp[0, :3]).all()  # both 3.0s kept
    e = torch.tensor([4.0, 3.0, 3.0]).exp()
    assert torch.allclose(probs(lp)[0, :3], e / e.sum(), atol=1e-6)


def test_top_p_smallest_set_reaching_mass():
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    lp = process_logits(p.log(), top_p=0.8)  # 0.5 < 0.8, 0.5+0.3 = 0.8 reaches it: keep 2
    assert torch.isfinite(lp[0, :2]).all() and torch.isinf(lp[0, 2:]).all()
    assert torch.allclose(probs(lp)[0, :2], torch.tensor([0.5, 0.3]) / 0.8, atol=1e-6)
    lp = process_logits(p.log(), top_p=0.81)  # needs the third
    assert torch.isfinite(lp[0, :3]).all() and torch.isinf(lp[0, 3])
    lp = process_logits(p.log(), top_p=0.01)  # top token always kept
    assert torch.isfinite(lp[0, 0]) and torch.isinf(lp[0, 1:]).all()


def test_top_p_keeps_tied_group():
    p = torch.tensor([[0.4, 0.2, 0.2, 0.2]])
    lp = process_logits(p.log(), top_p=0.5)  # 0.4 < 0.5 -> the tied 0.2s are all kept
    assert torch.isfinite(lp).all()


def test_order_temperature_then_top_k_then_top_p():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    lp = process_logits(logits, temperature=2.0, top_k=3, top_p=0.7)
    z = torch.tensor([1.5, 1.0, 0.5])
    q = torch.softmax(z, -1)  # top-k renormalised: [0.506, 0.307, 0.186]
    keep = 2 if q[0] < 0.7 <= q[0] + q[1] else None
    assert keep == 2
    assert torch.allclose(probs(lp)[0, :2], q[:2] / q[:2].sum(), atol=1e-6)
    assert torch.isinf(lp[0, 2:]).all()


def test_greedy_is_one_hot_and_rows_are_independent():
    logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 1.0, 0.0]])
    lp = process_logits(logits, temperature=torch.tensor([0.0, 1.0]), top_k=torch.tensor([0, 2]), top_p=torch.tensor([1.0, 1.0]))
    assert lp[0].tolist() == [-math.inf, 0.0, -math.inf]
    assert torch.isinf(lp[1, 2]) and torch.allclose(probs(lp)[1, :2].sum(), torch.tensor(1.0))


def test_matches_hf_warpers_without_ties():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    for t, k, p in [(0.7, 0, 1.0), (1.3, 10, 1.0), (0.8, 0, 0.9), (0.6, 20, 0.75)]:
        z = TemperatureLogitsWarper(t)(None, logits.clone())
        if k:
            z = TopKLogitsWarper(k)(None, z)
        if p < 1:
            z = TopPLogitsWarper(p)(None, z)
        assert torch.allclose(process_logits(logits, t, k, p), torch.log_softmax(z, -1), atol=1e-5, equal_nan=False)


def _chi2(counts, expected):
    return float(((counts - expected) ** 2 / expected).sum())


def test_sample_chi_square_tiny_vocab():
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -3.0, 0.7, 1.5])
    lp = process_logits(logits[None], temperature=0.9, top_k=6)  # support of 6 tokens
    N = 20000
    u = counter_uniforms(torch.full((N,), 7), torch.arange(N), torch.zeros(N, dtype=torch.long))
    toks = sample(lp.expand(N, -1), u)
    counts = torch.bincount(toks, minlength=8).double()
    p = probs(lp)[0].double()
    assert counts[p == 0].sum() == 0  # never outside the kept set
    keep = p > 0
    assert _chi2(counts[keep], N * p[keep]) < CHI2_999[int(keep.sum()) - 1]


def test_sample_large_vocab_chunk_boundaries():
    g = torch.Generator().manual_seed(1)
    V = 1000  # not a multiple of the chunk count: padded
    lp = process_logits(torch.randn(1, V, generator=g), top_k=5)
    N = 5000
    toks = sample(lp.expand(N, -1), counter_uniforms(torch.full((N,), 3), torch.arange(N), torch.zeros(N, dtype=torch.long)))
    p = probs(lp)[0].double()
    counts = torch.bincount(toks, minlength=V).double()
    assert counts[p == 0].sum() == 0
    assert _chi2(counts[p > 0], N * p[p > 0]) < CHI2_999[4]


def test_counter_uniforms_reproducible_and_distinct():
    s, j, t = torch.tensor([1, 1, 2]), torch.tensor([0, 1, 0]), torch.tensor([5, 5, 5])
    a, b = counter_uniforms(s, j, t), counter_uniforms(s, j, t)
    assert torch.equal(a, b) and len(set(a.tolist())) == 3
    big = counter_uniforms(torch.full((4,), 2**62 + 5), torch.zeros(4, dtype=torch.long), torch.arange(4))
    assert ((big >= 0) & (big < 1)).all()
    u = counter_uniforms(torch.zeros(50000, dtype=torch.long), torch.zeros(50000, dtype=torch.long), torch.arange(50000))
    counts = torch.histc(u.float(), bins=10, min=0, max=1).double()
    assert _chi2(counts, torch.full((10,), 5000.0, dtype=torch.float64)) < 27.88  # df 9, p = 0.001


def test_counter_uniforms_kernel_equals_the_tensor_ops():
    """The C++ pass computes the eager hashes' integers exactly: negative and full 64-bit seeds, indices and steps past
    2^32 (only their low 32 bits count), int32 inputs, expanded (stride-0) ones."""
    from posttrain.ops import cpu_kernels
    from posttrain.ops.sampling import _counter_uniforms_eager

    if cpu_kernels.load() is None:
        pytest.skip("kernels not built here")
    g = torch.Generator().manual_seed(0)
    n = 4096
    seed = torch.randint(-(2**63), 2**63 - 1, (n,), generator=g)
    seed[:4] = torch.tensor([0, -1, 2**63 - 1, -(2**63)])
    idx = torch.randint(0, 2**40, (n,), generator=g)
    step = torch.randint(0, 2**36, (n,), generator=g)
    assert torch.equal(counter_uniforms(seed, idx, step), _counter_uniforms_eager(seed, idx, step))
    small = (torch.arange(8, dtype=torch.int32), torch.arange(8, dtype=torch.int32), torch.tensor(3).expand(8))
    assert torch.equal(counter_uniforms(*small), _counter_uniforms_eager(*small))


@pytest.mark.parametrize("bad", [0.0, 1.0])
def test_sample_edges_never_pick_zero_probability(bad):
    lp = torch.full((1, 300), -math.inf)
    lp[0, 17] = math.log(0.25)
    lp[0, 290] = math.log(0.75)
    t = sample(lp, torch.tensor([bad - 2**-24 if bad else 0.0]))
    assert t.item() in (17, 290)


def test_sample_logits_fast_paths_match_process_logits_and_sample():
    torch.manual_seed(0)
    N, V = 12, 1000
    logits = torch.randn(N, V) * 3
    temp = torch.tensor([1.0, 0.7, 0.0, 1.3, 1.0, 0.9, 0.0, 1.0, 2.0, 1.0, 0.5, 1.0])
    top_k = torch.tensor([0, 0, 0, 0, 20, 0, 5, V, 0, 0, 0, 3])
    top_p = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.9, 1.0, 1.0, 1.0, 0.95, 1.0, 0.5])
    u = counter_uniforms(torch.full((N,), 9), torch.arange(N), torch.zeros(N, dtype=torch.long))
    tok, lp = sample_logits(logits, temp, top_k, top_p, u)
    ref_lp = torch.cat([process_logits(logits[i:i + 1], temp[i], top_k[i], top_p[i]) for i in range(N)])
    assert tok.tolist() == sample(ref_lp, u).tolist()
    assert (lp - ref_lp.gather(1, tok[:, None]).squeeze(1)).abs().max() < 1e-5
    tok2, lp2, kept = sample_logits(logits, temp, top_k, top_p, u, with_kept=True)
    assert torch.equal(tok2, tok) and torch.equal(lp2, lp)
    truncated = (temp > 0) & (((top_k > 0) & (top_k < V)) | (top_p < 1))
    assert kept.tolist() == torch.where(truncated, torch.isfinite(ref_lp).sum(-1), 0).tolist()
    for i in range(N):  # a row's draw does not depend on the other rows (fast path chosen per row)
        t1, l1 = sample_logits(logits[i:i + 1], temp[i:i + 1], top_k[i:i + 1], top_p[i:i + 1], u[i:i + 1])
        assert t1.item() == tok[i].item() and l1.item() == lp[i].item()


# ---------------------------------------------------------------- kept counts (engine set size -> trainer)


def _kept(lp):
    return torch.isfinite(lp).sum(-1)


def test_kept_logprobs_equals_process_logits_for_every_kept_token():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 300, generator=g) * 2
    logits[4, 7] = logits[4, 9] = logits[4].max() - 0.5  # a tie (kept by top_k=2 as a group of 3 with the max)
    T = torch.tensor([0.7, 1.0, 1.3, 0.9, 1.0])
    k, p = torch.tensor([10, 0, 40, 0, 2]), torch.tensor([1.0, 0.9, 0.8, 0.5, 1.0])
    ref = process_logits(logits, T, k, p)
    kept = _kept(ref)
    assert kept[4] == 3
    for r in range(5):
        idx = torch.isfinite(ref[r]).nonzero().squeeze(1)  # every token of the kept set as the target
        n = idx.numel()
        got, _ = kept_logprobs(logits[r].expand(n, -1), T[r], kept[r].expand(n), idx)
        # same set, same values: equal up to fp32 rounding (logsumexp over K values vs log_softmax over V)
        torch.testing.assert_close(got, ref[r, idx], atol=1e-6, rtol=0)


def test_kept_logprobs_hand_worked_target_outside_top_kept_and_plain_rows():
    z = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 3)
    lp, ent = kept_logprobs(z, 1.0, torch.tensor([2, 2, 0]), torch.tensor([0, 3, 3]), with_entropy=True)
    e = torch.tensor([3.0, 2.0, 1.0, 0.0]).double().exp()
    # row 0: set {3, 2}; row 1: target 3 (value 0) replaces the smallest kept (value 2): set {3, 0};
    # row 2: kept 0 = no truncation, plain softmax over all four
    expect = [3 - math.log(e[0] + e[1]), 0 - math.log(e[0] + e[3]), 0 - math.log(e.sum())]
    torch.testing.assert_close(lp, torch.tensor(expect, dtype=torch.float32), atol=1e-6, rtol=0)
    q = e[[0, 3]] / (e[0] + e[3])
    torch.testing.assert_close(ent[1], -(q * q.log()).sum().float(), atol=1e-6, rtol=0)
    pf = e / e.sum()
    torch.testing.assert_close(ent[2], -(pf * pf.log()).sum().float(), atol=1e-6, rtol=0)
    lp2, _ = kept_logprobs(z * 2, 2.0, torch.tensor([2, 2, 0]), torch.tensor([0, 3, 3]))  # temperature divides
    torch.testing.assert_close(lp2, lp, atol=1e-6, rtol=0)


def test_kept_logprobs_ties_at_the_edge_do_not_depend_on_which_tied_index_is_picked():
    z = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]] * 3)
    lp, _ = kept_logprobs(z, 1.0, torch.tensor([2, 2, 2]), torch.tensor([1, 2, 3]))  # each tied token as target
    expect = 1 - math.log(math.exp(2) + math.exp(1))
    assert torch.allclose(lp, torch.full((3,), expect), atol=1e-6)


def test_kept_logprobs_gradient():
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(4, 30, generator=g, dtype=torch.float64) * 2).requires_grad_()
    kept, targets = torch.tensor([3, 0, 5, 1]), torch.tensor([0, 7, 29, 11])
    assert torch.autograd.gradcheck(lambda x: kept_logprobs(x, 0.8, kept, targets)[0], (logits,))
    lp, _ = kept_logprobs(logits, 0.8, kept, targets)
    lp.sum().backward()
    grad = logits.grad
    assert (grad != 0).sum(-1).tolist() == [3, 30, 5, 0]  # only the set's logits move (a set of 1: log p = 0)
    assert torch.allclose(grad.sum(-1), torch.zeros(4, dtype=torch.float64), atol=1e-12)  # d/dz of (z_t - lse)


def test_trainer_logprobs_paths():
    g = torch.Generator().manual_seed(5)
    logits, targets = torch.randn(6, 50, generator=g), torch.randint(0, 50, (6,), generator=g)
    plain, ent = trainer_logprobs(logits, targets, 0.7, with_entropy=True)  # kept None, nothing truncates
    full = torch.log_softmax(logits / 0.7, -1)
    torch.testing.assert_close(plain, full.gather(1, targets[:, None]).squeeze(1), atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, -(full.exp() * full).sum(-1), atol=1e-5, rtol=0)
    zeros, _ = trainer_logprobs(logits, targets, 0.7, torch.zeros(6, dtype=torch.long), top_k=5)  # kept wins
    torch.testing.assert_close(zeros, plain, atol=0, rtol=0)
    fallback, _ = trainer_logprobs(logits, targets, 0.7, None, top_k=5)  # e.g. vLLM: process_logits
    ref = process_logits(logits, 0.7, 5).gather(1, targets[:, None]).squeeze(1)
    assert torch.equal(fallback, ref)
    greedy, _ = trainer_logprobs(logits, logits.argmax(-1), 0.0, torch.zeros(6, dtype=torch.long))
    assert greedy.tolist() == [0.0] * 6


def test_nucleus_edge_token_survives_logit_noise_with_kept_counts():
    """Regression: the engine draws the token at the top-p edge; the trainer's logits differ by 1e-6 (fp32
    noise of another kernel). process_logits then cuts it (-inf); the kept count keeps it, near-equal."""
    engine_logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    probs = torch.softmax(engine_logits, -1)
    mass_above_2 = torch.cumsum(probs, -1)[0, 1]  # as process_logits computes it: token 2 kept iff < top_p
    top_p = torch.nextafter(torch.nextafter(mass_above_2, torch.tensor(1.0)), torch.tensor(1.0))  # 2 ulps above
    tok, lp, kept = sample_logits(engine_logits, torch.ones(1), torch.zeros(1, dtype=torch.long), top_p.reshape(1),
                                  torch.tensor([0.97], dtype=torch.float64), with_kept=True)
    assert tok.item() == 2 and kept.item() == 3 and torch.isfinite(lp).all()  # drawn from {0, 1, 2}
    trainer_logits = engine_logits + torch.tensor([[1e-6, 1e-6, 0.0, 0.0]])  # tokens 0, 1 gain ~1.6e-7 mass
    old = process_logits(trainer_logits, 1.0, 0, top_p).gather(1, tok[:, None]).squeeze(1)
    assert torch.isinf(old).all()  # the old recomputation drops the drawn token
    new, _ = trainer_logprobs(trainer_logits, tok, 1.0, kept)
    assert torch.isfinite(new).all() and (new - lp).abs().item() < 5e-6
