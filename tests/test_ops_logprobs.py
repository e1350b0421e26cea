import pytest
import torch

from posttrain.ops.logprobs import chunked_logprobs, reference_logprobs
from posttrain.ops.masked import masked_mean, masked_var


@pytest.mark.parametrize("temperature,chunk", [(1.0, 7), (0.6, 64), (1.7, 3)])
def test_matches_full_softmax_and_gradcheck(temperature, chunk):
    torch.manual_seed(0)
    n, h, v = 20, 8, 30
    hid = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, h, dtype=torch.float64, requires_grad=True)
    b = torch.randn(v, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, v, (n,))
    got, ent = chunked_logprobs(hid, w, y, b, temperature=temperature, chunk=chunk, with_entropy=True)
    torch.testing.assert_close(got, reference_logprobs(hid, w, y, b, temperature))
    p = torch.softmax((hid @ w.T + b) / temperature, -1)
    torch.testing.assert_close(ent, -(p * p.log()).sum(-1))
    assert torch.autograd.gradcheck(lambda a, c, d: chunked_logprobs(a, c, y, d, temperature=temperature, chunk=chunk)[0], (hid, w, b))


@pytest.mark.parametrize("chunk", [8, 64])  # recompute per chunk | keep the forward's softmax (one chunk)
def test_fp32_gradients_match_autograd(chunk):
    torch.manual_seed(1)
    hid = torch.randn(50, 16, requires_grad=True)
    w = torch.randn(100, 16, requires_grad=True)
    y = torch.randint(0, 100, (50,))
    weights = torch.rand(50)
    (chunked_logprobs(hid, w, y, chunk=chunk)[0] * weights).sum().backward()
    g1 = hid.grad.clone(), w.grad.clone()
    hid.grad = w.grad = None
    (reference_logprobs(hid, w, y) * weights).sum().backward()
    torch.testing.assert_close(g1[0], hid.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(g1[1], w.grad, atol=1e-5, rtol=1e-4)


def test_masked_reductions_by_hand():
    v = torch.tensor([1.0, 2.0, 3.0, 100.0])
    m = torch.tensor([1, 1, 1, 0])
    assert masked_mean(v, m).item() == pytest.approx(2.0)
    assert masked_var(v, m).item() == pytest.approx(1.0)  # ((1-2)^2 + 0 + (3-2)^2) / (3-1)
    assert masked_var(v, m, unbiased=False).item() == pytest.approx(2 / 3)


def _kernel_or_skip():
    from posttrain.ops import cpu_kernels

    if not cpu_kernels._float_rows(torch.zeros(1, 8)):
        pytest.skip("fused row kernels not built here (needs x86-64 with AVX2 and a compiler)")
    return cpu_kernels


@pytest.mark.parametrize("n,v", [(3, 5), (33, 1001), (70, 4099)])
@pytest.mark.parametrize("want_entropy", [True, False])
def test_fused_head_softmax_matches_float64_and_the_eager_twin(n, v, want_entropy, monkeypatch):
    """cpu_kernels.softmax_rows_ (the kept softmax of the LM head) against the float64 softmax: log-probs, lse and
    entropy within float32 rounding of values of their size, p within a few ulps; and no farther from it than the
    eager ops it replaces."""
    from posttrain.ops import logprobs as lp

    ck = _kernel_or_skip()
    torch.manual_seed(v)
    z = torch.randn(n, v) * 4
    z[0, : min(3, v)] = 60.0  # a peaked row: p near 1 and the rest underflowing towards 0
    y = torch.randint(0, v, (n,))
    ref = z.double()
    lse = torch.logsumexp(ref, 1)
    want = (ref.gather(1, y[:, None]).squeeze(1) - lse, lse, -(torch.softmax(ref, 1) * torch.log_softmax(ref, 1)).sum(1))
    got_p = z.clone()
    got = ck.softmax_rows_(got_p, y, want_entropy)
    monkeypatch.setattr(ck, "softmax_rows_", lambda *a: None)
    eager_p = z.clone()
    eager = lp._softmax_in_place(eager_p, y, want_entropy)
    eps = torch.finfo(torch.float32).eps
    for g, e, w in zip(got, eager, want):
        if w is None or g is None:
            assert g is None and e is None and not want_entropy
            continue
        bound = 4 * eps * (w.abs() + lse.abs() + 1)  # a few roundings of numbers the size of lse
        assert ((g.double() - w).abs() <= bound).all()
        # no farther than the eager twin beyond the lse's own rounding (its sums run in another order)
        assert ((g.double() - w).abs() <= (e.double() - w).abs() + 2 * eps * (w.abs() + lse.abs() + 1)).all()
    # p = exp(z − lse): relative error of a few ulps plus the roundings of lse and of z − lse, scaled by their size
    p, y_abs = torch.softmax(ref, 1), (ref - lse[:, None]).abs()
    assert ((got_p.double() - p).abs() <= eps * p * (4 + 2 * (lse.abs()[:, None] + y_abs)) + 1e-30).all()


def test_fused_exp_rows_is_the_kept_softmax_exp():
    """p of the kept softmax == exp_rows_(z, lse) bit for bit: a recomputing backward forms the same p."""
    ck = _kernel_or_skip()
    torch.manual_seed(0)
    z = torch.randn(9, 1003) * 3
    p = z.clone()
    _, lse, _ = ck.softmax_rows_(p, torch.zeros(9, dtype=torch.long), False)
    assert torch.equal(p, ck.exp_rows_(z.clone(), lse))


def test_kept_and_recomputed_softmax_give_the_same_gradient():
    """The first backward uses the forward's kept softmax, a second one (retain_graph) recomputes it from the
    saved lse: equal gradients, bit for bit (both form p = exp(z − lse) with one routine)."""
    torch.manual_seed(2)
    hid = torch.randn(40, 16, requires_grad=True)
    w = torch.randn(300, 16, requires_grad=True)
    y = torch.randint(0, 300, (40,))
    out = (chunked_logprobs(hid, w, y, chunk=64)[0] * torch.rand(40)).sum()
    out.backward(retain_graph=True)
    first = hid.grad.clone(), w.grad.clone()
    hid.grad = w.grad = None
    out.backward()
    assert torch.equal(first[0], hid.grad) and torch.equal(first[1], w.grad)
