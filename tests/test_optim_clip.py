"""optim.clip_grad_norm: torch's clip_grad_norm_, the same bits, without its multiplication by 1 on the CPU."""

import math

import pytest
import torch

from posttrain.training.optim import clip_grad_norm


def _params(scale: float, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(*shape, generator=gen)) for shape in ((7, 5), (5,), (3, 4, 2))]
    for p in params:
        p.grad = scale * torch.randn(p.shape, generator=gen)
    params.append(torch.nn.Parameter(torch.zeros(2)))  # no gradient: skipped by both
    return params


@pytest.mark.parametrize("scale, max_norm", [(0.01, 1.0), (10.0, 1.0), (10.0, 0.0), (1.0, -1.0)])
def test_same_norm_and_gradients_as_torch(scale, max_norm):
    ours, theirs = _params(scale), _params(scale)
    norm = clip_grad_norm(ours, max_norm)
    ref = torch.nn.utils.clip_grad_norm_(theirs, max_norm if max_norm > 0 else math.inf)
    assert torch.equal(norm, ref)
    for a, b in zip(ours, theirs):
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)
    clipped = max_norm > 0 and float(ref) > max_norm
    assert clipped == (scale == 10.0 and max_norm > 0)  # the cases cover both branches


def test_unclipped_gradients_are_left_untouched():
    params = _params(0.01)
    before = [p.grad for p in params]
    versions = [None if g is None else g._version for g in before]
    clip_grad_norm(params, 1.0)
    assert [None if p.grad is None else p.grad._version for p in params] == versions  # no pass wrote them


def test_nonfinite_norm_scales_as_torch_does():
    ours, theirs = _params(1.0), _params(1.0)
    ours[0].grad[0, 0] = theirs[0].grad[0, 0] = float("nan")
    norm, ref = clip_grad_norm(ours, 1.0), torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert norm.isnan() and ref.isnan()
    assert all(torch.equal(a.grad.isnan(), b.grad.isnan()) for a, b in zip(ours[:3], theirs[:3]))
    assert ours[1].grad.isnan().all()  # every gradient scaled by the NaN coefficient, as torch does


def test_no_gradients_give_a_zero_norm():
    params = [torch.nn.Parameter(torch.ones(3))]
    assert float(clip_grad_norm(params, 1.0)) == 0.0
