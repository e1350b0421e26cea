"""posttrain.ops.sampling: exact semantics on hand-made logits, distribution (chi-square), reproducibility."""

import math

import pytest
import torch

from posttrain.ops.sampling import counter_uniforms, process_logits, sample

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


@pytest.mark.parametrize("bad", [0.0, 1.0])
def test_sample_edges_never_pick_zero_probability(bad):
    lp = torch.full((1, 300), -math.inf)
    lp[0, 17] = math.log(0.25)
    lp[0, 290] = math.log(0.75)
    t = sample(lp, torch.tensor([bad - 2**-24 if bad else 0.0]))
    assert t.item() in (17, 290)


def test_sample_logits_fast_paths_match_process_logits_and_sample():
    from posttrain.ops.sampling import sample_logits
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
    for i in range(N):  # a row's draw does not depend on the other rows (fast path chosen per row)
        t1, l1 = sample_logits(logits[i:i + 1], temp[i:i + 1], top_k[i:i + 1], top_p[i:i + 1], u[i:i + 1])
        assert t1.item() == tok[i].item() and l1.item() == lp[i].item()
