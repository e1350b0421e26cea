"""benchmarks/engine_attention.py: its two KV layouts hold the same step, so both sides compute the same attention."""

import pytest
import torch
import torch.nn.functional as F
from engine_attention import make_step

from posttrain.ops import cpu_kernels


@pytest.mark.parametrize("own", [0, 5])
def test_group_and_per_sample_layouts_give_the_same_attention(own):
    if not cpu_kernels.group_attention_runs(torch.device("cpu"), torch.float32, 16):
        pytest.skip("group_attention kernel not built here")
    group, sdpa, flops = make_step([3, 7], samples=3, own=own, H=4, KV=2, D=16, dtype=torch.float32)
    ours = cpu_kernels.group_attention(**group, scale=0.25, window=None)
    theirs = F.scaled_dot_product_attention(sdpa["q"], sdpa["k"], sdpa["v"], attn_mask=sdpa["mask"], scale=0.25, enable_gqa=True)
    torch.testing.assert_close(ours, theirs.reshape(6, 4 * 16), rtol=1e-5, atol=1e-5)  # float32, two summation orders
    assert flops == 4 * 4 * 16 * 3 * ((3 + own + 1) + (7 + own + 1))
    # the group layout's own keys are where the kernel looks: sample m's token j at P + j*W + m
    if own:
        k = group["k_cache"]
        assert torch.equal(k[1, :, 7 + 2: 7 + 2 + 3 * own: 3], sdpa["k"][5, :, 7:7 + own])
