"""The model log-probs the engine reports (SamplingParams.logprobs / prompt_logprobs, what `posttrain serve` returns):
the raw distribution at each sampled token, kept through preemption, equal to one forward of prompt + completion."""

from posttrain.models.loading import load_model, load_tokenizer
from posttrain.rollout.engine import Engine, EngineConfig
from posttrain.rollout.scoring import prompt_logprobs
from posttrain.rollout.types import Request, SamplingParams


def test_reported_logprobs_survive_preemption_and_equal_a_full_forward():
    tok, model = load_tokenizer("tiny-random"), load_model("tiny-random").eval()
    engine = Engine(model, tok, EngineConfig(max_num_seqs=8, kv_cache_mb=0.05, max_model_len=96, block_size=4))
    reqs = [Request(tok(f"prompt number {i} is here")["input_ids"],
                    SamplingParams(n=2, max_new_tokens=24, ignore_eos=True, seed=i, temperature=0.7, top_k=50, logprobs=2))
            for i in range(4)]
    outs = engine.generate(reqs)
    assert engine.stats.preemptions > 0 and engine._reporting == 0
    for r, o in zip(reqs, outs):
        for s in o.samples:
            assert len(s.model_logprobs) == len(s.token_ids) and all(len(x.top) == 2 for x in s.model_logprobs)
            ref = prompt_logprobs(model, r.prompt_token_ids + s.token_ids)[len(r.prompt_token_ids):]
            # the model's own distribution (temperature 1, no top-k), not the sampling one (s.logprobs)
            assert max(abs(a.logprob - b.logprob) for a, b in zip(s.model_logprobs, ref)) < 1e-4
            assert all(x.logprob <= x.top[0][1] for x in s.model_logprobs)


def test_scoring_only_requests_and_prompt_logprobs():
    tok, model = load_tokenizer("tiny-random"), load_model("tiny-random").eval()
    engine = Engine(model, tok, EngineConfig(max_num_seqs=4, kv_cache_mb=8, max_model_len=64))
    ids = tok("score this text please")["input_ids"]
    full = [Request(list(range(3, 67)), SamplingParams(max_new_tokens=0, prompt_logprobs=0))]  # the whole context: allowed
    out, = engine.generate([Request(ids, SamplingParams(n=2, max_new_tokens=0, prompt_logprobs=3, logprobs=1))])
    assert [s.token_ids for s in out.samples] == [[], []] and out.samples[0].model_logprobs == []
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    assert all(len(x.top) == 3 and x.top[0][1] >= x.top[1][1] for x in out.prompt_logprobs[1:])
    assert engine.generate(full)[0].ok and not engine.generate([Request(list(range(3, 68)), SamplingParams(max_new_tokens=0))])[0].ok
    gen, = engine.generate([Request(ids, SamplingParams(max_new_tokens=3, prompt_logprobs=0, temperature=0))])
    assert [x.logprob for x in gen.prompt_logprobs[1:]] == [x.logprob for x in out.prompt_logprobs[1:]]
