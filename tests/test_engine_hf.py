"""Built-in engine vs transformers on the tiny models: greedy equality, behaviour log-probs vs the trainer's
recomputation, distribution, seeds, prefix cache, preemption, bad requests, weight updates."""

import pytest
import torch

from posttrain.models.loading import load_model, load_tokenizer
from posttrain.ops import cpu_kernels
from posttrain.ops.sampling import process_logits, trainer_logprobs
from posttrain.rollout.engine import Engine, EngineConfig
from posttrain.rollout.hf_backend import HFBackend
from posttrain.rollout.types import Request, SamplingParams

PROMPTS = [[5, 6, 7], list(range(10, 27)), list(range(100, 140)), [900, 3, 44, 17, 8, 250, 9, 11, 64]]


@pytest.fixture(scope="module", params=["tiny-random", "tiny-random-qwen2"])
def model(request):
    return load_model(request.param).eval()


def engine(model, **kw):
    cfg = dict(max_num_seqs=16, max_model_len=128, kv_cache_mb=8, block_size=8)
    cfg.update(kw)
    return Engine(model, None, EngineConfig(**cfg))


def hf_greedy(model, prompt, n):
    """n greedy tokens with no stop token, as the engine's ignore_eos (min_new_tokens would mask EOS out of HF's
    argmax, so an argmax on the EOS id would differ)."""
    ids = torch.tensor([prompt])  # explicit mask: token 3 is the pad id and would be masked otherwise
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, eos_token_id=None)
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt):].tolist()


def recompute(model, prompt, completion, params, kept=None):
    """What a trainer does: full forward over prompt + completion, then the log-probs of the completion
    tokens: over the engine's kept-set sizes when given (`Completion.kept_counts`), else process_logits."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1]
    kept = None if kept is None else torch.tensor(kept)
    return trainer_logprobs(logits, torch.tensor(completion), params.temperature, kept, params.top_k, params.top_p)[0]


def test_greedy_equals_hf_generate(model):
    outs = engine(model).generate([Request(p, SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)) for p in PROMPTS])
    for p, o in zip(PROMPTS, outs):
        ref = hf_greedy(model, p, 16)
        assert o.samples[0].token_ids == ref
        assert o.samples[0].finish_reason == "length" and o.samples[0].logprobs == [0.0] * 16


@pytest.mark.parametrize("params", [SamplingParams(n=3, temperature=0.7, max_new_tokens=20, seed=1),
                                    SamplingParams(n=3, temperature=1.3, top_p=0.9, max_new_tokens=20, seed=2),
                                    SamplingParams(n=3, temperature=0.8, top_k=20, top_p=0.95, max_new_tokens=20, seed=3)])
def test_behaviour_logprobs_equal_trainer_recomputation(model, params):
    """The trainer recomputes over the engine's kept-set sizes, so a token at the top-p edge cannot fall
    outside its set through logit noise (process_logits on the HF logits gave -inf / 6e-4 gaps here).
    Tolerance: both sides are fp32 logits of the same weights in different summation orders (a few ulps).
    With z = logits / T, log p(t) = z_t - logsumexp_S z moves by at most 2 max|Δz| for a fixed set S, and a
    swap of two near-tied members at the edge of S (|z_a - z_b| <= 2 max|Δz|) by at most as much again:
    the same order as the untruncated case (params0, no set at all). Measured worst: 2.2e-6 over both
    models and all three params (params0 1.9e-6; params1 on tiny-random 9.5e-7, was 6.0e-4 with
    process_logits), so 1e-5 holds with margin."""
    outs = engine(model).generate([Request(p, params) for p in PROMPTS])
    worst = 0.0
    for p, o in zip(PROMPTS, outs):
        assert len(o.samples) == 3
        for s in o.samples:
            assert (s.kept_counts is None) == (not params.truncates())
            if s.kept_counts is not None:
                assert len(s.kept_counts) == len(s.token_ids) and min(s.kept_counts) >= 1
                assert params.top_k == 0 or max(s.kept_counts) <= params.top_k  # (no exact ties in these logits)
            ref = recompute(model, p, s.token_ids, params, s.kept_counts)
            worst = max(worst, (torch.tensor(s.logprobs) - ref).abs().max().item())
    assert worst < 1e-5, worst


def test_engine_first_token_distribution_chi_square(model):
    params = SamplingParams(n=800, temperature=0.9, top_k=5, max_new_tokens=1, seed=11)
    p = PROMPTS[1]
    out = engine(model, max_num_seqs=64).generate([Request(p, params)])[0]
    with torch.no_grad():
        probs = process_logits(model(torch.tensor([p])).logits[0, -1], 0.9, 5, 1.0).exp().double()
    counts = torch.bincount(torch.tensor([s.token_ids[0] for s in out.samples]), minlength=probs.numel()).double()
    keep = probs > 0
    assert counts[~keep].sum() == 0
    chi2 = float(((counts[keep] - 800 * probs[keep]) ** 2 / (800 * probs[keep])).sum())
    assert chi2 < 18.47  # df 4, p = 0.001


def test_seed_reproducible_regardless_of_batch(model):
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=123)
    alone = engine(model).generate([Request(PROMPTS[2], params)])[0]
    others = [Request(p, SamplingParams(n=3, max_new_tokens=9, seed=i)) for i, p in enumerate(PROMPTS)]
    mixed = engine(model, max_num_seqs=5).generate(others[:2] + [Request(PROMPTS[2], params)] + others[2:])[2]
    assert [s.token_ids for s in alone.samples] == [s.token_ids for s in mixed.samples]
    assert alone.samples[0].token_ids != alone.samples[1].token_ids
    other_seed = engine(model).generate([Request(PROMPTS[2], SamplingParams(n=2, max_new_tokens=16, seed=124))])[0]
    assert other_seed.samples[0].token_ids != alone.samples[0].token_ids


def test_preemption_gives_the_same_samples(model):
    params = SamplingParams(n=4, temperature=1.0, top_p=0.95, max_new_tokens=28, ignore_eos=True, seed=5)
    reqs = [Request(p, params) for p in PROMPTS]
    big = engine(model).generate(reqs)
    tight = engine(model, kv_cache_mb=0.12, max_model_len=80)  # 0.12 MiB = 240 tokens: forces preemption
    small = tight.generate(reqs)
    assert tight.stats.preemptions > 0
    for a, b in zip(big, small):
        assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
        assert [s.kept_counts for s in a.samples] == [s.kept_counts for s in b.samples]  # restored on resume
        for x, y in zip(a.samples, b.samples):
            assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < 1e-5


def test_group_prefill_once_and_multi_turn_prefix_cache(model):
    eng = engine(model)
    p = list(range(200, 237))  # 37 tokens
    out = eng.generate([Request(p, SamplingParams(n=6, max_new_tokens=12, ignore_eos=True, seed=0))])[0]
    assert eng.stats.prefill_tokens == 37  # 6 samples, one prefill
    turn2 = p + out.samples[0].token_ids + [300, 301, 302]
    eng.stats.prefill_tokens = 0
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    o2 = eng.generate([Request(turn2, params)])[0]
    assert o2.num_cached_prompt_tokens >= 40 and eng.stats.prefill_tokens <= len(turn2) - 40
    ref = hf_greedy(model, turn2, 10)
    assert o2.samples[0].token_ids == ref  # the cached prefix gives the same result


PATHS = {"layer-loop": {}, "group-kernel": {"layer_loop": False}, "masked-sdpa": {"layer_loop": False, "group_kernel": False},
         "tensor-layout": {"step_kernels": False}}


@pytest.mark.parametrize("path", PATHS)
def test_decode_writes_each_new_kv_to_its_paged_row(model, path):
    """Each decode step's new k/v (position p of sample m, at P + (p - P) * width + m in its group region) also lands
    at table[p // block] * block + p % block of the paged cache, so a finished sample's KV is in the prefix cache
    without a copy; block boundaries included, on every decode path over the group KV."""
    if path != "masked-sdpa" and cpu_kernels.load() is None:
        pytest.skip("CPU kernels not built here")
    eng = engine(model)
    r = eng.runner
    for name, value in PATHS[path].items():
        setattr(r, name, value)
    tables, finish = {}, eng.scheduler.finish

    def record(s):  # the blocks and group slot of each sample as it finishes (its blocks are freed after)
        tables[s.sample_index] = (list(s.block_table), s.slot, s.prompt_len, s.computed_at(eng.scheduler.step))
        finish(s)

    eng.scheduler.finish = record
    eng.generate([Request(list(range(200, 237)), SamplingParams(n=4, max_new_tokens=30, ignore_eos=True, seed=0))])
    assert sorted(tables) == [0, 1, 2, 3]
    bs = r.block_size
    for table, slot, P, end in tables.values():
        gs, m = divmod(slot, r.width)
        assert end == P + 29  # the last token's KV is never computed
        p = torch.arange(P, end)
        off, dst = P + (p - P) * r.width + m, torch.tensor(table)[p // bs] * bs + p % bs
        for cache, region in ((r.k_cache, r.k_slot), (r.v_cache, r.v_slot)):
            assert torch.equal(cache[:, dst], region[:, gs].index_select(2, off).transpose(1, 2))


def test_bad_requests_fail_alone(model):
    good = SamplingParams(n=2, max_new_tokens=5, seed=0)
    reqs = [Request(PROMPTS[0], good), Request([], good), Request(list(range(200)), good),
            Request(PROMPTS[1], SamplingParams(temperature=-1)), Request(PROMPTS[1], SamplingParams(top_p=0)),
            Request(PROMPTS[1], SamplingParams(top_k=-3)), Request(PROMPTS[1], SamplingParams(n=0)),
            Request([5, 99999], good), Request(PROMPTS[3], good)]
    outs = engine(model).generate(reqs)
    assert outs[0].ok and outs[-1].ok and len(outs[-1].samples) == 2
    errors = [o.error for o in outs[1:-1]]
    assert all(errors)
    for needle, e in zip(["empty prompt", "context holds 128", "temperature", "top_p", "top_k", "n must", "token ids"], errors):
        assert needle in e, e


def test_stop_tokens_and_stop_strings(model):
    tok = load_tokenizer("tiny-random")
    eng = Engine(model, tok, EngineConfig(max_num_seqs=8, max_model_len=128, kv_cache_mb=8))
    free = eng.generate([Request(PROMPTS[1], SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True))])[0].samples[0]
    stop_tok = free.token_ids[5]
    first = free.token_ids.index(stop_tok)
    s = eng.generate([Request(PROMPTS[1], SamplingParams(temperature=0, max_new_tokens=20, stop_token_ids=[stop_tok]))])[0].samples[0]
    assert s.token_ids == free.token_ids[:first + 1] and s.finish_reason == "stop" and s.stop_reason == stop_tok
    text = tok.decode(free.token_ids[:8])
    needle = text[-3:] if text[-3:].strip() else text[-5:]
    s2 = eng.generate([Request(PROMPTS[1], SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True, stop_strings=[needle]))])[0].samples[0]
    assert s2.finish_reason == "stop" and needle in tok.decode(s2.token_ids) and len(s2.token_ids) <= 8
    assert needle not in tok.decode(s2.token_ids[:-1])


def test_weights_shared_in_place_and_update_weights():
    model = load_model("tiny-random")
    eng = engine(model)
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    before = eng.generate([Request(PROMPTS[2], params)])[0].samples[0].token_ids
    assert eng.runner.layers[0].mlp.up_proj.weight is model.model.layers[0].mlp.up_proj.weight  # no copy
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with torch.enable_grad():
        loss = model(torch.tensor([PROMPTS[2] + before])).logits.float().pow(2).mean()
        loss.backward()
    opt.step()  # a trainer step, in place on the same tensors
    after = eng.generate([Request(PROMPTS[2], params)])[0].samples[0].token_ids
    ref = hf_greedy(model, PROMPTS[2], 12)
    assert after == ref and after != before  # the stale prefix cache was dropped
    other = load_model("tiny-random", seed=1)
    eng.update_weights(other.state_dict())
    got = eng.generate([Request(PROMPTS[2], params)])[0].samples[0].token_ids
    ref = hf_greedy(other, PROMPTS[2], 12)
    assert got == ref


def test_hf_backend_logprobs_are_its_sampling_distribution(model):
    params = SamplingParams(n=2, temperature=0.7, top_k=30, max_new_tokens=10, seed=4)
    outs = HFBackend(model).generate([Request(p, params) for p in PROMPTS[:2]] + [Request([], params)])
    assert outs[2].error and "empty prompt" in outs[2].error
    for p, o in zip(PROMPTS, outs[:2]):
        for s in o.samples:
            assert s.kept_counts is not None and max(s.kept_counts) <= 30
            assert (torch.tensor(s.logprobs) - recompute(model, p, s.token_ids, params, s.kept_counts)).abs().max() < 1e-4


def test_metrics(model):
    eng = engine(model)
    eng.generate([Request(p, SamplingParams(n=2, max_new_tokens=6, ignore_eos=True)) for p in PROMPTS])
    m = eng.metrics()
    assert m["generated_tokens"] == 48 and m["decode_steps"] == 5 and 0 < m["batch_occupancy"] <= 1
    assert m["peak_kv_mb"] > 0 and m["kv_in_use_mb"] == 0 and m["prefill_tokens"] == sum(map(len, PROMPTS))


@pytest.mark.slow
def test_smollm2_greedy_equals_hf():
    name = "smollm2-135m-instruct"
    model, tok = load_model(name).eval(), load_tokenizer(name)
    msgs = ["What is 2+2?", "Write a haiku about the sea.", "Explain gravity to a child in two sentences.", "hi"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True, tokenize=True, return_dict=False) for m in msgs]
    outs = Engine(model, tok, EngineConfig(max_num_seqs=8, max_model_len=512, kv_cache_mb=256)).generate(
        [Request(p, SamplingParams(temperature=0, max_new_tokens=48)) for p in prompts])
    for p, o in zip(prompts, outs):
        ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), do_sample=False, max_new_tokens=48)[0, len(p):].tolist()
        assert o.samples[0].token_ids == ref
    params = SamplingParams(n=2, temperature=0.7, top_p=0.9, max_new_tokens=24, seed=0)
    outs = Engine(model, tok, EngineConfig(max_num_seqs=8, max_model_len=512, kv_cache_mb=256)).generate([Request(p, params) for p in prompts])
    worst = max((torch.tensor(s.logprobs) - recompute(model, p, s.token_ids, params, s.kept_counts)).abs().max().item()
                for p, o in zip(prompts, outs) for s in o.samples)
    assert worst < 1e-4


def test_packed_weights_follow_optimizer_steps_between_steps_and_data_writes():
    model = load_model("tiny-random")
    packed, plain = engine(model), engine(model, pack_weights=False)
    params = SamplingParams(n=2, temperature=0.8, max_new_tokens=10, ignore_eos=True, seed=7)
    a, b = packed.generate([Request(PROMPTS[1], params)])[0], plain.generate([Request(PROMPTS[1], params)])[0]
    assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
    assert max(abs(x - y) for s, t in zip(a.samples, b.samples) for x, y in zip(s.logprobs, t.logprobs)) < 1e-5
    lin = packed.runner.gate_up[0]
    dense = lambda t: t.to_dense() if t.is_mkldnn else t  # oneDNN's packed weight is an mkldnn tensor
    w = dense(lin.w).clone()  # (posttrain's GEMM re-packs in place: compare contents)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with torch.enable_grad():
        model(torch.tensor([PROMPTS[1]])).logits.float().pow(2).mean().backward()
    opt.step()  # in place, between two step() calls of an interleaving caller
    greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    packed.add_request(Request(PROMPTS[2], greedy))
    packed.step()
    assert not torch.equal(dense(lin.w), w)  # rebuilt from the new weights
    m = model.model.layers[0].mlp
    x = torch.randn(3, m.gate_proj.weight.shape[1])
    with torch.no_grad():
        torch.testing.assert_close(lin(x), torch.cat([m.gate_proj(x), m.up_proj(x)], -1), atol=1e-5, rtol=1e-5)
    while packed.scheduler.has_work():
        packed.step()
    assert packed.generate([Request(PROMPTS[2], greedy)])[0].samples[0].token_ids == hf_greedy(model, PROMPTS[2], 12)
    with torch.no_grad():  # .data writes bypass version counters: sync_weights() rebuilds
        for p in model.parameters():
            p.data.mul_(1.5)
    packed.sync_weights()
    assert packed.generate([Request(PROMPTS[2], greedy)])[0].samples[0].token_ids == hf_greedy(model, PROMPTS[2], 12)


def assert_same_samples(outs: dict, ref) -> None:
    """Every run in `outs` drew the same tokens as `ref`, with log-probs within 1e-5."""
    for key, got in outs.items():
        for a, b in zip(ref, got):
            assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples], key
            assert max(abs(x - y) for s, t in zip(a.samples, b.samples) for x, y in zip(s.logprobs, t.logprobs)) < 1e-5


def test_slot_kv_equals_paged_gather_with_preemption_and_slot_reuse(model):
    # uneven lengths: slots free up and are reused out of order, so decode rows are not slots 0..B-1
    reqs = [Request(p, SamplingParams(n=4, temperature=0.9, max_new_tokens=8 + 8 * i, ignore_eos=True, seed=i)) for i, p in enumerate(PROMPTS)]
    outs = {}
    for slot_kv in (True, False):
        for kv_mb in (8, 0.12):  # 0.12 MiB (240 tokens) forces preemption
            eng = engine(model, slot_kv=slot_kv, kv_cache_mb=kv_mb, max_model_len=80)
            outs[slot_kv, kv_mb] = eng.generate(reqs)
            assert (eng.stats.preemptions > 0) == (kv_mb < 1)
    assert_same_samples(outs, ref=outs[False, 8])


def test_group_kv_equals_per_sequence_slots_with_early_stops(model):
    """Group KV (each group's prompt once, samples interleaved; width = n) == one slot per sequence,
    with samples of a group stopping at different steps (stop ids on frequent tokens) and preemption."""
    stops = list(range(0, 1000, 31))  # ~1/31 of the tiny vocab: samples stop at scattered steps
    reqs = [Request(p, SamplingParams(n=4, temperature=1.0, max_new_tokens=40, stop_token_ids=stops, seed=i))
            for i, p in enumerate(PROMPTS)]
    outs, widths = {}, {}
    for group_kv in (True, False):
        for kv_mb in (8, 0.06):  # 0.06 MiB (120 tokens) forces preemption
            eng = engine(model, group_kv=group_kv, kv_cache_mb=kv_mb, max_model_len=80)
            outs[group_kv, kv_mb] = eng.generate(reqs)
            widths[group_kv, kv_mb] = eng.scheduler.width
            assert (eng.stats.preemptions > 0) == (kv_mb < 1)
    assert widths == {(True, 8): 4, (True, 0.06): 4, (False, 8): 1, (False, 0.06): 1}
    lens = {len(s.token_ids) for o in outs[True, 8] for s in o.samples}
    assert len(lens) > 3  # samples of one group finished at different steps
    assert_same_samples(outs, ref=outs[False, 8])


def test_group_kv_grows_no_further_than_its_groups_reach(model):
    """The group KV doubles as decode reaches further, but never past what its groups can reach (P + width x the
    tokens they may feed): here 17 + 4 x 40 = 177 positions, where doubling alone would go 64 -> 128 -> 256."""
    reqs = [Request(PROMPTS[1], SamplingParams(n=4, temperature=1.0, max_new_tokens=40, ignore_eos=True, seed=3))]
    outs = {}
    for group_kv in (True, False):
        eng = engine(model, group_kv=group_kv, max_model_len=200)
        outs[group_kv] = eng.generate(reqs)
        if group_kv:
            assert eng.scheduler.width == 4 and eng.runner.k_slot.shape[3] == len(PROMPTS[1]) + 4 * 40
    assert_same_samples(outs, ref=outs[False])


def test_group_width_policy(model):
    eng = engine(model, max_num_seqs=8)
    same = SamplingParams(n=4, max_new_tokens=2, ignore_eos=True)
    eng.generate([Request(PROMPTS[0], same), Request(PROMPTS[1], same)])
    assert eng.scheduler.width == 4  # 2 x 4 samples run at once: slots per group
    eng.generate([Request(p, same) for p in PROMPTS])
    assert eng.scheduler.width == 1  # 16 samples > 8 slots: per-sequence slots, refilled as each finishes
    eng.generate([Request(PROMPTS[0], same), Request(PROMPTS[1], SamplingParams(n=2, max_new_tokens=2))])
    assert eng.scheduler.width == 1  # mixed n


def test_add_request_on_idle_engine_uses_per_sequence_slots(model):
    eng = engine(model, max_num_seqs=8)
    eng.generate([Request(PROMPTS[0], SamplingParams(n=4, max_new_tokens=2, ignore_eos=True))] * 2)
    assert eng.scheduler.width == 4
    states = [eng.add_request(Request(p, SamplingParams(max_new_tokens=2, ignore_eos=True)), i) for i, p in enumerate(PROMPTS)]
    assert eng.scheduler.width == 1  # four single-sample requests must not take a group slot of 4 each
    eng.step()  # one prefill admits all four
    assert len(eng.scheduler.running) == 4
    while eng.scheduler.has_work():
        eng.step()
    assert all(len(s.output.samples) == 1 for s in states)


@pytest.mark.parametrize("name", ["tiny-random", "tiny-random-qwen2"])
def test_bf16_engine_with_fused_kernels_tracks_hf_bf16(name):
    """The bf16 path (fused RMSNorm/RoPE kernels, fused residual adds, group KV) stays within bf16 noise of
    an HF bf16 forward over the same tokens (an indexing bug in RoPE or the group KV would be nats off)."""
    model = load_model(name, dtype="bfloat16").eval()
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=24, ignore_eos=True, seed=7)
    eng = engine(model)
    outs = eng.generate([Request(p, params) for p in PROMPTS])
    assert eng.scheduler.width == 4
    worst = 0.0
    for p, o in zip(PROMPTS, outs):
        for s in o.samples:
            ref = recompute(model, p, s.token_ids, params)
            worst = max(worst, (torch.tensor(s.logprobs) - ref).abs().max().item())
    assert worst < 0.1, worst  # measured 0.024 here; the RoPE position bug it guards against gave 1.8


@pytest.mark.parametrize("name", ["tiny-random", "tiny-random-qwen2", "tiny-random-qwen3", "tiny-random-gemma2",
                                  "tiny-random-olmo2"])  # + per-head / full q,k norms, gemma's norm and embed scale
def test_bf16_compute_over_fp32_weights_is_the_bf16_model(name):
    """EngineConfig(dtype="bfloat16") over fp32 master weights (mixed-precision RL) draws exactly what the engine
    draws over the model cast to bf16: the same tokens and log-probs, bit for bit, before and after an optimizer
    step on the fp32 weights (the bf16 copy is rebuilt at sync_weights)."""
    import copy

    model = load_model(name).eval()  # fp32
    params = SamplingParams(n=4, temperature=1.0, top_p=0.9, max_new_tokens=16, ignore_eos=True, seed=3)
    mixed = engine(model, dtype="bfloat16")
    assert mixed.runner.k_cache.dtype == torch.bfloat16 and mixed.runner.qkv[0].dtype == torch.bfloat16

    def same_as_cast():
        ref = copy.deepcopy(model)
        for p in ref.parameters():  # parameters only: like a bf16 load, RoPE's inv_freq buffer stays fp32
            p.data = p.data.to(torch.bfloat16)
        cast = engine(ref)
        reqs = [Request(p, params) for p in PROMPTS]
        for a, b in zip(mixed.generate(reqs), cast.generate(reqs)):
            assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
            assert [s.logprobs for s in a.samples] == [s.logprobs for s in b.samples]
            assert [s.kept_counts for s in a.samples] == [s.kept_counts for s in b.samples]

    same_as_cast()
    with torch.enable_grad():
        model(torch.tensor([PROMPTS[1]])).logits.pow(2).mean().backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    mixed.sync_weights()
    same_as_cast()
    assert model.model.embed_tokens.weight.dtype == torch.float32  # the master weights stay fp32
    assert mixed.memory_bytes() < engine(model).memory_bytes()  # KV and packed copies at half the bytes


def test_fp32_engine_computes_norms_and_swiglu_as_the_trainer_does():
    """Where load_model switched a module to its fused class (training runs the float32 kernels), the engine runs the
    same kernels for it, bit for bit; a module left eager keeps the eager ops in the engine too."""
    from posttrain.ops import cpu_kernels, layers

    if cpu_kernels.load() is None:
        pytest.skip("the fused CPU kernels could not be built here")
    model = load_model("tiny-random")
    layer, H = model.model.layers[0], model.config.hidden_size
    x = torch.randn(5, H)
    gu = torch.randn(5, 2 * layer.mlp.gate_proj.out_features)  # the gate|up output; _gated takes its strided halves
    g, u = gu.chunk(2, -1)
    with torch.no_grad():
        for fused in (True, False):
            layers.use_fused_layers(model, enabled=fused)
            runner = engine(model).runner
            assert runner.attn_in[0].fused == fused and runner.fused_mlp[0] == fused
            assert torch.equal(runner.attn_in[0](x), layer.input_layernorm(x))
            expect = layers.swiglu(g.contiguous(), u.contiguous()) if fused else torch.nn.functional.silu(g) * u
            assert torch.equal(runner._gated(0, gu), expect)
