"""Comparing two bf16 matmuls that sum the same bf16 products in fp32 in different orders (ops/linear.py's fp32
GEMM over bf16 values against oneDNN's bf16 GEMM)."""

import torch


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps separate a and b elementwise (both bf16-representable, same sign or zero)."""
    return (a.to(torch.bfloat16).view(torch.int16).int() - b.to(torch.bfloat16).view(torch.int16).int()).abs()


def assert_same_bf16_matmul(got: torch.Tensor, want: torch.Tensor, share: float = 0.01) -> None:
    """The two differ only where the fp32 sum lies within its summation-order error of a bf16 rounding
    boundary: by one bf16 step, at under `share` of the elements. Unrounded operands (fp32 values multiplied)
    would move most elements."""
    assert got.dtype == want.dtype
    apart = ulps_apart(got.float(), want.float())
    assert apart.max() <= 1 and (apart > 0).float().mean() < share, (apart.max(), (apart > 0).float().mean())
