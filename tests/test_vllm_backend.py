"""backend=vllm on vLLM's CPU build (`make test-vllm`: .venv-vllm), against the built-in engine and transformers on the
tiny random model: greedy equality, behaviour log-probs and kept-set sizes vs the trainer's recomputation, weight
updates after an optimizer step, an RL run through build_backend, a killed engine process.

Skipped where vllm does not import (the project's .venv); `make test` deselects the marker."""

import json
import os

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vLLM is not installed here: make test-vllm (its own .venv-vllm)")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per engine (vLLM's CPU default is 4)
# no torch.compile warm-up (minutes on 2 cores): eager kernels, the same numbers
os.environ.setdefault("POSTTRAIN_VLLM_ARGS", '{"enforce_eager": true}')

from conftest import run_rl  # noqa: E402
from posttrain.models.builtin import build_tiny  # noqa: E402
from posttrain.models.loading import load_model, load_tokenizer  # noqa: E402
from posttrain.ops.sampling import trainer_logprobs  # noqa: E402
from posttrain.rollout.backends import build_backend  # noqa: E402
from posttrain.rollout.engine import Engine, EngineConfig  # noqa: E402
from posttrain.rollout.types import Request, SamplingParams  # noqa: E402
from posttrain.rollout.vllm_backend import VLLMBackend, VLLMEngineDead  # noqa: E402
from test_rl_recipe import space_share  # noqa: E402, F401  (registers the reward run_rl uses)

PROMPTS = [[5, 6, 7], list(range(10, 27)), list(range(100, 140)), [900, 3, 44, 17, 8, 250, 9, 11, 64]]
CFG = EngineConfig(max_num_seqs=16, max_model_len=128, kv_cache_mb=8, block_size=8, seed=0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny llama with head_dim 64 (vLLM's CPU attention has no head_dim 16 kernel, the tiny models' size:
    'Unsupported CPU attention configuration: head_dim=16'), saved as a model folder with the tiny tokenizer."""
    path = tmp_path_factory.mktemp("tiny-hd64")
    build_tiny("tiny-random", hidden_size=128, num_attention_heads=2, num_key_value_heads=1).save_pretrained(path)
    load_tokenizer("tiny-random").save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tok(folder):
    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def setup(folder, tok):
    """(policy, its vLLM backend): vLLM's engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: one vLLM start-up
    less), built as every recipe builds it."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        model = load_model(folder).eval()
        backend = build_backend("vllm", model, tok, CFG, model_name=folder, dtype="float32")
    finally:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
    assert isinstance(backend, VLLMBackend) and backend.name == "vllm"
    yield model, backend
    backend.close()


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def recompute(model, prompt, completion, params, kept):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1]
    return trainer_logprobs(logits, torch.tensor(completion), params.temperature,
                            None if kept is None else torch.tensor(kept), params.top_k, params.top_p)[0]


def test_greedy_equals_builtin_engine_and_hf(setup):
    model, vb = setup
    greedy = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    v = vb.generate([Request(p, greedy) for p in PROMPTS])
    e = Engine(model, None, CFG).generate([Request(p, greedy) for p in PROMPTS])
    for p, a, b in zip(PROMPTS, v, e):
        assert a.ok and a.samples[0].token_ids == b.samples[0].token_ids == hf_greedy(model, p, 16)
        assert a.samples[0].finish_reason == "length" and a.samples[0].logprobs == [0.0] * 16


def test_stop_token_ends_a_sample_as_the_engine_does(setup):
    model, vb = setup
    first = hf_greedy(model, PROMPTS[1], 6)
    params = SamplingParams(temperature=0, max_new_tokens=16, stop_token_ids=[first[3]])
    s = vb.generate([Request(PROMPTS[1], params)])[0].samples[0]
    cut = first.index(first[3]) + 1
    assert s.token_ids == first[:cut] and s.finish_reason == "stop" and s.stop_reason == first[3]


@pytest.mark.parametrize("params", [SamplingParams(n=3, temperature=0.7, max_new_tokens=20, seed=1),
                                    SamplingParams(n=3, temperature=1.3, top_p=0.9, max_new_tokens=20, seed=2),
                                    SamplingParams(n=3, temperature=0.8, top_k=20, top_p=0.95, max_new_tokens=20, seed=3),
                                    SamplingParams(n=3, temperature=1.0, top_k=20, max_new_tokens=20, seed=4)])
def test_behaviour_logprobs_and_kept_sets_equal_trainer_recomputation(setup, params):
    """vLLM reports the sampled token's log-prob under the processed (tempered, truncated) distribution; the backend
    reads the kept-set size off it, and the trainer's kept_logprobs over that size reproduces it. Tolerance: fp32
    on both sides, different kernels (vLLM's CPU attention vs SDPA): the engine's test measures ~2e-6 for its own."""
    model, vb = setup
    worst, tokens = 0.0, 0
    for p, o in zip(PROMPTS, vb.generate([Request(p, params) for p in PROMPTS])):
        assert len(o.samples) == 3
        for s in o.samples:
            assert (s.kept_counts is None) == (not params.truncates(1024))  # the tiny vocabulary
            if params.top_k and params.top_p == 1:
                assert set(s.kept_counts) == {params.top_k}  # top-k alone: the set is exactly k (no ties here)
            ref = recompute(model, p, s.token_ids, params, s.kept_counts)
            worst, tokens = max(worst, (torch.tensor(s.logprobs) - ref).abs().max().item()), tokens + len(s.token_ids)
    assert tokens > 100 and worst < 1e-4, worst


def test_seeded_requests_over_several_prefill_chunks_do_not_kill_the_engine(setup):
    """Every RL request is seeded. vLLM 0.32's CPU worker died ('CPU Generator does not use offset') on a seeded request
    whose prompt chunked prefill split across steps; the backend turns chunked prefill off on the CPU. 96 prompts of
    100 tokens (9600, more than one step's token budget; crashed the old code): every sample comes back, the same for the
    same seeds."""
    _, vb = setup
    reqs = [Request([(7 * i + j) % 1000 + 5 for j in range(100)], SamplingParams(n=2, temperature=1.0, max_new_tokens=8,
                                                                                  ignore_eos=True, seed=i)) for i in range(96)]
    first, again = vb.generate(reqs), vb.generate(reqs[:3])
    assert all(o.ok and len(o.samples) == 2 and all(len(c.token_ids) == 8 for c in o.samples) for o in first)
    assert [[c.token_ids for c in o.samples] for o in again] == [[c.token_ids for c in o.samples] for o in first[:3]]


def test_after_an_optimizer_step_vllm_samples_the_new_weights(setup, folder):
    model, vb = setup
    greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    before = [o.samples[0].token_ids for o in vb.generate([Request(p, greedy) for p in PROMPTS])]
    policy = load_model(folder)
    vb.source = policy  # the trainer's model
    opt = torch.optim.SGD(policy.parameters(), lr=5.0)
    ids = torch.tensor([PROMPTS[2]])
    policy(ids, labels=torch.flip(ids, [1])).loss.backward()
    opt.step()
    vb.sync_weights()
    after = [o.samples[0].token_ids for o in vb.generate([Request(p, greedy) for p in PROMPTS])]
    assert after != before
    assert after == [hf_greedy(policy.eval(), p, 12) for p in PROMPTS]
    sums = vb.weight_sums()
    assert sums["model.embed_tokens.weight"] == pytest.approx(float(policy.model.embed_tokens.weight.detach().double().sum()), rel=1e-6)
    vb.source = model
    vb.sync_weights()  # back to the module's model for the other tests


def test_rl_run_with_backend_vllm_keeps_trainer_and_sampler_consistent(tmp_path, folder):
    """`posttrain rl backend=vllm` through build_backend: vLLM samples (top_p < 1, kept sets read off its log-probs),
    sync_weights after each optimizer step; the trainer's recomputation stays within posttrain's consistency alarm
    (dlogp_mean 0.2 nats) by orders of magnitude, on every step including those after updates."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        summary, out = run_rl(tmp_path, f"model={folder}", "backend=vllm", "max_steps=3", "sampling.top_p=0.9")
    finally:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    assert all(r["consistency/dlogp_max"] < 1e-4 for r in rows), [r["consistency/dlogp_max"] for r in rows]
    assert all(r["consistency/dlogp_mean"] < 1e-5 for r in rows)


@pytest.mark.timeout(300)  # the failure this guards against is a hang
@pytest.mark.parametrize("call,wait", [("generate", True), ("generate", False), ("update_weights", False)])
def test_a_killed_vllm_engine_is_reported(folder, call, wait):
    """vLLM's default: the engine in its own process. Killing it makes the next call raise VLLMEngineDead naming the
    process and its exit code, not a hang or a bare ZMQ error, whether the call comes after the death is seen
    (wait: the process joined) or races it (vLLM's client then took the request and, unwoken, waited forever)."""
    import vllm.envs

    vllm.envs.disable_envs_cache()  # an engine built earlier in this process froze VLLM_ENABLE_V1_MULTIPROCESSING=0
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    try:
        vb = VLLMBackend(folder, dtype="float32", max_model_len=128)  # enforce_eager from POSTTRAIN_VLLM_ARGS
    finally:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
    what = {"generate": "generating", "update_weights": "loading weights"}[call]
    try:
        assert vb.generate([Request(PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=4))])[0].ok
        (proc,) = vb.llm.llm_engine.engine_core.resources.engine_manager.processes
        os.kill(proc.pid, 9)
        if wait:
            proc.join(30)
        with pytest.raises(VLLMEngineDead, match=rf"engine process died while {what}.*pid {proc.pid} exited with code -9"):
            if call == "generate":
                vb.generate([Request(PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=4))])
            else:
                vb.update_weights({})
    finally:
        vb.close()
