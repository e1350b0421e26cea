"""The engine's decode layer loop in C++ (`cpu_kernels.decode_layers`) against the runner's Python loop over the same
kernels: the same sampled tokens and the same behaviour log-probs, bit for bit, for Llama, Qwen2 (q|k|v bias) and
Mistral (sliding window, generations past it), in float32 (training's fused kernels) and in bf16 (float32 panels of
widened bf16, as on AVX2 CPUs); which models it takes; weight changes reach it."""

import pytest
import torch

from posttrain.models.builtin import build_tiny
from posttrain.ops import cpu_kernels
from posttrain.ops.layers import use_fused_layers
from posttrain.rollout import runner
from posttrain.rollout.engine import Engine, EngineConfig
from posttrain.rollout.types import Request, SamplingParams

pytestmark = pytest.mark.skipif(not cpu_kernels.decode_layers_runs(),
                                reason="the decode layer loop needs the CPU kernels (x86-64 with AVX2 and FMA, GCC >= 12)")

SHORT, LONG = list(range(5, 13)), list(range(100, 140))  # inside and past the tiny Mistral's 16-token window
PROMPTS = [SHORT, LONG, [900, 3, 44, 17, 8, 250, 9, 11, 64, 7, 300, 512, 1000, 2, 77]]


@pytest.fixture
def packed_gemm(monkeypatch):
    """Every linear on posttrain's packed GEMM (float32 panels; bf16 widened), whatever this CPU's rule picks."""
    monkeypatch.setattr(runner, "ENGINE_GEMM", True)
    monkeypatch.setattr(runner, "ENGINE_GEMM_BF16", False)
    monkeypatch.setattr(runner, "WIDEN_PACKED_BF16", True)
    monkeypatch.setattr(runner, "WIDEN_MIN_ROWS", 1)  # at any decode batch


def engine(name: str, dtype: torch.dtype, fused: bool = True, cast: bool = False) -> Engine:  # cast: weights in dtype
    model = build_tiny(name).eval()
    if cast:  # the weights themselves in the compute dtype
        model = model.to(dtype)
    if fused:
        use_fused_layers(model)
    cfg = EngineConfig(max_num_seqs=12, max_model_len=96, kv_cache_mb=8, block_size=8,
                       dtype="bfloat16" if dtype == torch.bfloat16 else "float32")
    return Engine(model, None, cfg)


def samples(eng: Engine, loop: bool) -> list[tuple[list[int], list[float]]]:
    eng.runner.layer_loop = loop
    eng.reset_prefix_cache()
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=28, ignore_eos=True, seed=7)
    return [(s.token_ids, s.logprobs) for o in eng.generate([Request(p, params) for p in PROMPTS]) for s in o.samples]


@pytest.mark.parametrize("name", ["tiny-random", "tiny-random-qwen2", "tiny-random-mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_layer_loop_samples_what_the_python_loop_samples(packed_gemm, name, dtype):
    eng = engine(name, dtype)
    assert eng.runner._loop is not None
    looped = samples(eng, True)
    assert eng.scheduler.width == 4  # decode ran over the group KV (where the loop runs)
    assert looped == samples(eng, False)
    assert len({tuple(t) for t, _ in looped}) > 3  # sampled, not one repeated sequence


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_whole_step_in_one_call_samples_what_the_layer_loop_samples(packed_gemm, dtype):
    """`decode_step` (embedding, RoPE rows, layers, final norm and LM head in one call) against the layer loop between
    the runner's own embedding and LM head: the same tokens and log-probs, with the weights in the compute dtype and
    (bf16) as float32 master weights whose embedding rows are cast per step."""
    for eng in (engine("tiny-random", dtype, cast=True), engine("tiny-random", dtype)):
        assert eng.runner._ends
        whole = samples(eng, True)
        eng.runner._ends = False
        assert whole == samples(eng, True) == samples(eng, False)


def test_a_weight_change_reaches_the_loop_at_the_next_refresh(packed_gemm):
    eng = engine("tiny-random", torch.bfloat16)
    before = samples(eng, True)
    hf = eng.runner.model.model
    with torch.no_grad():
        hf.layers[0].post_attention_layernorm.weight.mul_(3)
        hf.layers[1].mlp.down_proj.weight.mul_(-1)
    eng.runner.refresh_weights()
    after = samples(eng, True)
    assert after != before and after == samples(eng, False)


def test_what_the_loop_leaves_to_python(packed_gemm, monkeypatch):
    # float32 norms the module does not run fused: the runner computes them eagerly, so the loop is off
    assert engine("tiny-random", torch.float32, fused=False).runner._loop is None
    # post-norms and soft-capping (Gemma 2), q/k norms (Qwen3)
    assert engine("tiny-random-gemma2", torch.float32).runner._loop is None
    assert engine("tiny-random-qwen3", torch.float32).runner._loop is None
    # a linear off the packed GEMM (oneDNN or BLAS)
    monkeypatch.setattr(runner, "ENGINE_GEMM", False)
    assert engine("tiny-random", torch.float32).runner._loop is None
