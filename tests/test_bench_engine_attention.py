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


def test_engine_vs_hf_states_the_attention_alone_at_its_shape(monkeypatch):
    import engine_attention
    import engine_vs_hf

    from posttrain.models.builtin import build_tiny
    from posttrain.rollout.runner import Runner

    runner = Runner(build_tiny("tiny-random").eval(), 16, 8, 64)
    cfg = runner.layers[0].self_attn.config
    run = {"prompt_lens": [5, 9], "samples": 4, "new_tokens": 10}
    assert engine_vs_hf.attention_alone(runner, **{**run, "samples": 1}) == {}  # one sample a prompt: no group KV
    gemma2 = Runner(build_tiny("tiny-random-gemma2").eval(), 16, 8, 64)
    assert engine_vs_hf.attention_alone(gemma2, **run) == {}  # soft-capped: masked SDPA
    if not runner.group_kernel:
        pytest.skip("group_attention kernel not built here")
    seen = {}

    def fake_compare(lens, samples, own, H, KV, D, dtype, reps):  # the shape it asks for; no timing in a test
        seen.update(lens=lens, samples=samples, own=own, heads=(H, KV))
        return {"ours_us": 100.0, "sdpa_us": 250.0, "ours_over_peak": 0.25}

    monkeypatch.setattr(engine_attention, "compare", fake_compare)
    got = engine_vs_hf.attention_alone(runner, **run)
    assert seen == {"lens": [5, 9], "samples": 4, "own": 5, "heads": (cfg.num_attention_heads, cfg.num_key_value_heads)}
    layers = cfg.num_hidden_layers
    assert got == pytest.approx({"attention_alone_ms": 0.1 * layers, "attention_sdpa_ms": 0.25 * layers, "attention_over_peak": 0.25})
