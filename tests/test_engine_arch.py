"""Built-in engine vs transformers on every tiny architecture (llama, qwen2, mistral, qwen3, gemma2, gemma3,
phi3, olmo2), fp32: greedy tokens for prompts shorter and longer than the 16-token sliding windows and
generations that run past them (group KV, paged gather, prefix cache, preemption), behaviour log-probs vs
a plain HF forward, LoRA-wrapped models vs their merge, bf16 within bf16 noise, and the refusals."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from posttrain.errors import UserError
from posttrain.models.builtin import TINY_CONFIGS, build_tiny
from posttrain.models.forward import unwrap
from posttrain.rollout.engine import Engine, EngineConfig
from posttrain.rollout.runner import SUPPORTED, Runner, check_supported
from posttrain.rollout.types import Request, SamplingParams

NAMES = list(TINY_CONFIGS)
SHORT, LONG = list(range(5, 13)), list(range(100, 140))  # 8 and 40 tokens: inside and past a 16-token window
PROMPTS = [SHORT, LONG, [900, 3, 44, 17, 8, 250, 9, 11, 64, 7, 300, 512, 1000, 2, 77, 81, 19, 23, 4]]
NEW = 30  # generated tokens: the 8-token prompt's samples run past the window too


@pytest.fixture(scope="module", params=NAMES)
def model(request):
    return build_tiny(request.param).eval()


def engine(model, **kw):
    cfg = dict(max_num_seqs=16, max_model_len=128, kv_cache_mb=8, block_size=8)
    cfg.update(kw)
    return Engine(model, None, EngineConfig(**cfg))


def greedy(n=NEW, samples=1):
    return SamplingParams(n=samples, temperature=0, max_new_tokens=n, ignore_eos=True)


def hf_greedy(model, prompt, n=NEW):
    """HF's n greedy tokens with no stop token, like the engine's ignore_eos (min_new_tokens would instead
    mask EOS out of the argmax: an argmax on the EOS id 2 then differs)."""
    ids = torch.tensor([prompt])  # explicit mask: token 3 is the pad id and would be masked otherwise
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, eos_token_id=None)
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt):].tolist()


def hf_logprobs(model, prompt, completion, temperature):
    """A plain HF forward over prompt + completion: log_softmax(logits / T) at the completion tokens."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def test_every_tiny_architecture_is_supported():
    assert {build_tiny(n).config.model_type for n in NAMES} == set(SUPPORTED)


@pytest.mark.parametrize("slot_kv", [True, False], ids=["group_kv", "paged_gather"])
def test_greedy_equals_hf_generate_across_sliding_windows(model, slot_kv):
    """2 samples per request (group slots of width 2, or the paged-block gather) of 30 tokens after prompts
    of 8, 40 and 19 tokens: every sample is HF's greedy continuation."""
    eng = engine(model, slot_kv=slot_kv)
    outs = eng.generate([Request(p, greedy(samples=2)) for p in PROMPTS])
    assert eng.scheduler.width == (2 if slot_kv else 1)
    for p, o in zip(PROMPTS, outs):
        ref = hf_greedy(model, p)
        assert [s.token_ids for s in o.samples] == [ref, ref]


def test_window_changes_the_output():
    """The equality above is sensitive to the windows: without them the tiny models predict otherwise."""
    for name in ("tiny-random-mistral", "tiny-random-gemma2", "tiny-random-gemma3"):
        m = build_tiny(name).eval()
        eng = engine(m)
        eng.runner.windows, eng.runner.window_set = (None,) * len(eng.runner.windows), [None]
        assert eng.generate([Request(LONG, greedy())])[0].samples[0].token_ids != hf_greedy(m, LONG), name


def test_prefix_cache_past_the_window_equals_hf(model):
    """Turn 2 reuses turn 1's cached blocks (prompt + decoded tokens, 64 of 73 tokens cached): the
    prefill of its last 9 tokens attends cached keys under each layer's window."""
    eng = engine(model)
    first = eng.generate([Request(LONG, greedy())])[0].samples[0].token_ids
    turn2 = LONG + first + [300, 301, 302]
    out = eng.generate([Request(turn2, greedy(12))])[0]
    assert out.num_cached_prompt_tokens == 64
    assert out.samples[0].token_ids == hf_greedy(model, turn2, 12)


def test_preemption_past_the_window_gives_the_same_samples(model):
    """Recomputed sequences (prompt + generated tokens prefilled again, longer than the window) continue
    with the same tokens and log-probs as uninterrupted ones."""
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=NEW, ignore_eos=True, seed=5)
    reqs = [Request(p, params) for p in PROMPTS]
    big = engine(model).generate(reqs)
    tight = engine(model, kv_cache_mb=0.06, max_model_len=80)  # 0.06 MiB = 120 tokens: forces preemption
    small = tight.generate(reqs)
    assert tight.stats.preemptions > 0
    for a, b in zip(big, small):
        assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
        assert max(abs(x - y) for s, t in zip(a.samples, b.samples) for x, y in zip(s.logprobs, t.logprobs)) < 1e-5


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_equal_a_plain_hf_forward(model, temperature):
    """The engine's behaviour log-prob of each sampled token (untruncated: log_softmax(logits / T)) vs an
    HF forward over prompt + completion. Both are fp32 logits of the same weights summed in other orders
    (a few ulps, |logit| < 10 here); log p(t) = z_t - logsumexp z moves by at most 2 max|Δz| (z = logits / T),
    ~1e-6: 1e-5 holds with margin. A soft-cap or window error moves them by >= 1e-3."""
    params = SamplingParams(n=3, temperature=temperature, max_new_tokens=NEW, ignore_eos=True, seed=3)
    outs = engine(model).generate([Request(p, params) for p in PROMPTS])
    worst = 0.0
    for p, o in zip(PROMPTS, outs):
        assert len(o.samples) == 3 and len({tuple(s.token_ids) for s in o.samples}) > 1
        for s in o.samples:
            assert s.kept_counts is None
            worst = max(worst, (torch.tensor(s.logprobs) - hf_logprobs(model, p, s.token_ids, temperature)).abs().max().item())
    assert worst < 1e-5, worst


def lora_model(model, seed=0):
    """peft LoRA on every linear layer, B drawn at random (peft starts B at 0, a no-op adapter)."""
    peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # A too (peft draws it from the global generator: the test would depend on test order)
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.2 if "lora_B" in name else 0.3))
    return peft.eval()


def merged(peft):
    return copy.deepcopy(peft).merge_and_unload().eval()


def test_lora_model_generates_like_its_merge(model):
    """A PeftModel (or its unwrapped base with LoRA layers inside, as recipes pass it) generates the merged
    model's greedy tokens, packed or not; an in-place update of the adapter (an optimizer step) is picked up."""
    peft = lora_model(model)
    ref = [hf_greedy(merged(peft), p) for p in PROMPTS]
    assert ref != [hf_greedy(model, p) for p in PROMPTS]  # the adapter changes the output
    check_supported(peft)
    for wrapped, pack in ((peft, True), (unwrap(peft), True), (peft, False)):
        outs = engine(wrapped, pack_weights=pack).generate([Request(p, greedy(samples=2)) for p in PROMPTS])
        assert [o.samples[0].token_ids for o in outs] == ref
        assert [o.samples[1].token_ids for o in outs] == ref
    eng = engine(peft)
    eng.generate([Request(LONG, greedy())])
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.mul_(-1.5)  # in place: version counters change, the engine re-merges and drops its prefix cache
    assert eng.generate([Request(LONG, greedy())])[0].samples[0].token_ids == hf_greedy(merged(peft), LONG)


@pytest.mark.parametrize("name", NAMES)
def test_bf16_tracks_hf_bf16(name):
    """bf16 (fused kernels where the family allows, group KV): behaviour log-probs within bf16 noise of an
    HF bf16 forward; an indexing, norm or window bug is nats off (the llama RoPE bug this guards gave 1.8)."""
    model = build_tiny(name, dtype=torch.bfloat16).eval()
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=24, ignore_eos=True, seed=7)
    outs = engine(model).generate([Request(p, params) for p in PROMPTS])
    worst = max((torch.tensor(s.logprobs) - hf_logprobs(model, p, s.token_ids, 1.0)).abs().max().item()
                for p, o in zip(PROMPTS, outs) for s in o.samples)
    assert worst < 0.1, worst


# ------------------------------------------------------------------ rope types and refusals
def test_static_ranges_of_dynamic_and_longrope_run_and_beyond_are_refused():
    """dynamic NTK RoPE is static up to max_position_embeddings and longrope up to
    original_max_position_embeddings: inside, the engine equals HF; a max_model_len past longrope's switch
    is refused, naming the model type and backend=hf."""
    dyn = build_tiny("tiny-random", rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}).eval()
    assert engine(dyn).generate([Request(LONG, greedy())])[0].samples[0].token_ids == hf_greedy(dyn, LONG)
    with pytest.raises(UserError, match="dynamic"):
        Runner(dyn, 16, 8, 4096)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 96,
            "short_factor": [1.0 + i / 8 for i in range(8)], "long_factor": [4.0] * 8}
    phi = build_tiny("tiny-random-phi3", rope_parameters=rope, original_max_position_embeddings=96).eval()
    assert phi.model.rotary_emb.attention_scaling > 1  # factor 2048 / 96
    assert engine(phi, max_model_len=96).generate([Request(LONG, greedy())])[0].samples[0].token_ids == hf_greedy(phi, LONG)
    with pytest.raises(UserError, match=r"'phi3'.*longrope.*max_model_len <= 96.*backend=hf or backend=vllm"):
        engine(phi, max_model_len=128)


@pytest.mark.parametrize("name,overrides,windows,rotary", [
    ("tiny-random-phi3", dict(partial_rotary_factor=0.5, sliding_window=16), (16, 16), 8),  # 8 of head_dim 16 rotate
    ("tiny-random-qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1), (None, 16), 16),
])
def test_config_variants_equal_hf(name, overrides, windows, rotary):
    model = build_tiny(name, **overrides).eval()
    eng = engine(model)
    assert eng.runner.windows == windows and eng.runner.cos.shape[2] == rotary
    outs = eng.generate([Request(p, greedy(samples=2)) for p in PROMPTS])
    assert [o.samples[0].token_ids for o in outs] == [hf_greedy(model, p) for p in PROMPTS]


def tiny_hf(model_type, **kw):
    cfg = AutoConfig.for_model(model_type, vocab_size=1024, **kw)
    return AutoModelForCausalLM.from_config(cfg).eval()


def test_refusals_name_the_model_type_and_backends():
    shape = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
    with pytest.raises(UserError, match=r"'mixtral'.*experts.*backend=hf or backend=vllm"):
        engine(tiny_hf("mixtral", num_local_experts=2, num_experts_per_tok=1, **shape))
    with pytest.raises(UserError, match=r"'gpt2'.*runs llama, mistral.*backend=hf or backend=vllm"):
        engine(tiny_hf("gpt2", n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(UserError, match=r"'gemma3_text'.*bidirectional.*backend=hf"):
        check_supported(build_tiny("tiny-random-gemma3", use_bidirectional_attention=True))
    dora = get_peft_model(build_tiny("tiny-random"), LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(UserError, match=r"'llama'.*DoRA.*merge_and_unload"):
        engine(dora)
