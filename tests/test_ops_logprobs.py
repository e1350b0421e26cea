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
