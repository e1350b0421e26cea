"""Fused bf16 CPU kernels == the eager ops they replace, bit for bit (and the eager ops == HF's modules)."""

import os

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from posttrain.ops import cpu_kernels as K

needs_kernels = pytest.mark.skipif(os.environ.get("POSTTRAIN_CPU_KERNELS") == "0", reason="kernels turned off")


@needs_kernels
def test_kernels_build_here():
    assert K.load() is not None  # Linux + g++ + ninja: the CI machine must build them (else decode is slower)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_rmsnorm_kernel_equals_eager_and_hf(rows):
    g = torch.Generator().manual_seed(rows)
    big = (torch.randn(rows, 700, generator=g) * 4).bfloat16()
    x = big[:, :576]  # rows with a stride (a slice of a wider tensor)
    norm = LlamaRMSNorm(576, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576, generator=g) + 0.5)
    norm = norm.bfloat16()
    ref = K.rmsnorm_ref(x, norm.weight, 1e-5)
    with torch.no_grad():
        assert torch.equal(ref, norm(x))  # the eager twin is HF's module
    got = K.rmsnorm(x, norm.weight, 1e-5)
    assert got.dtype == torch.bfloat16 and torch.equal(got, ref)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 64, 257])
def test_rope_kernel_equals_eager_and_hf(rows):
    g = torch.Generator().manual_seed(rows)
    D, heads, kv = 64, 9, 3
    qkv = torch.randn(rows, (heads + 2 * kv) * D, generator=g).bfloat16()
    x = qkv[:, :(heads + kv) * D].view(rows, heads + kv, D)  # q and k heads, rows strided like the engine's
    ang = torch.rand(rows, D // 2, generator=g) * 50
    cos = torch.cat([ang.cos(), ang.cos()], -1).bfloat16()
    sin = torch.cat([ang.sin(), ang.sin()], -1).bfloat16()
    sin_signed = torch.cat([-sin[:, :D // 2], sin[:, D // 2:]], -1)
    ref = K.rope_ref(x, cos, sin_signed)
    q_hf, _ = apply_rotary_pos_emb(x.transpose(0, 1), x.transpose(0, 1), cos, sin, unsqueeze_dim=0)
    assert torch.equal(ref, q_hf.transpose(0, 1))
    got = K.rope(x, cos, sin_signed)
    assert torch.equal(got, ref)


def test_fallback_for_float32_and_odd_layouts():
    x = torch.randn(4, 32)
    w = torch.rand(32)
    assert torch.equal(K.rmsnorm(x, w, 1e-6), K.rmsnorm_ref(x, w, 1e-6))  # float32: the eager ops
    xt = torch.randn(32, 4).bfloat16().t()  # last dim not contiguous
    wb = w.bfloat16()
    assert torch.equal(K.rmsnorm(xt, wb, 1e-6), K.rmsnorm_ref(xt, wb, 1e-6))
