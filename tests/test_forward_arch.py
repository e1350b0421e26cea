"""The training forward on every tiny architecture equals the model's own forward.

posttrain computes log-probs with its varlen attention (packed rows, shared-prefix layouts) and a head
applied from lm_head's weight; transformers' eager attention over one sample at a time and the
model's own logits (its final soft-cap included) are the definition. Samples are longer than the
sliding window (16) of mistral / gemma2 / gemma3, so windows are exercised inside packed rows and
across a shared prefix. fp32 throughout: the two sides differ only in summation order (bucketed
SDPA vs one sequence, tiles vs one matmul), a few ulps of values of size ~10, so 1e-5 absolute on
log-probs and 1e-4 relative on gradients (sums over many tokens).
"""

import pytest
import torch

from posttrain.data.packing import collate
from posttrain.data.templates import Tokenized
from posttrain.errors import UserError
from posttrain.models.builtin import TINY_CONFIGS, build_tiny
from posttrain.models.forward import check_logit_head, logit_head, token_logprobs
from posttrain.models.loading import load_model
from posttrain.ops import attention
from posttrain.ops.logprobs import LogitHead, chunked_kept_logprobs, chunked_logprobs, reference_logprobs
from posttrain.ops.sampling import trainer_logprobs
from posttrain.recipes.rl import phases as ph
from posttrain.rollout.trajectory import Trajectory, make_batches

NAMES = list(TINY_CONFIGS)
ATOL = 1e-5  # log-probs of size ~7 (log 1024) in fp32


def eager_twin(name: str, seed: int = 0):
    """The same weights as load_model(name, seed=seed), with transformers' eager attention (the reference)."""
    model = build_tiny(name, seed=seed)
    model.set_attn_implementation("eager")
    return model


def plain_logprobs(model, ids: list[int], first: int) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= first from the model's own logits (its soft-cap included)."""
    logits = model(torch.tensor([ids])).logits[0, first - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(ids[first:])[:, None]).squeeze(1)


def random_ids(g, n):
    return torch.randint(5, 1000, (n,), generator=g).tolist()


def sample_grads(model, names=("embed_tokens", "layers.0.self_attn", "layers.1.mlp", "lm_head")):
    """Gradients of a few parameters (the first whose name contains each key)."""
    out = {}
    for key in names:
        for n, p in model.named_parameters():
            if key in n and p.grad is not None:
                out[key] = p.grad.clone()
                break
    return out


def assert_grads_close(got: dict, want: dict, rel: float = 1e-5):
    """Each gradient within `rel` of its largest entry: fp32 sums over ~200 tokens in another order
    (about 100 ulps of the sum's scale; a wrong mask or cap moves them by percent)."""
    assert got.keys() == want.keys() and len(got) >= 3
    for key in got:
        scale = float(want[key].abs().max())
        err = float((got[key] - want[key]).abs().max())
        assert scale > 0 and err <= rel * scale, f"{key}: max error {err:.3g}, scale {scale:.3g}"


@pytest.mark.parametrize("name", NAMES)
def test_packed_rows_equal_per_sample_forwards_with_gradients(name):
    """(a) + (c): three samples per row (lengths 40, 23, 37 > window 16), loss on all but each sample's
    first 5 tokens; token_logprobs and its gradient equal per-sample eager forwards."""
    g = torch.Generator().manual_seed(1)
    lengths = [[40, 23, 37], [29, 41]]
    rows = [[Tokenized(random_ids(g, n), [0] * 5 + [1] * (n - 5)) for n in row] for row in lengths]
    batch = collate(rows, pad_id=3, packed=True, pad_to_multiple_of=16)  # the second row has a padding tail
    model, ref = load_model(name, seed=2), eager_twin(name, seed=2)
    logp, _ = token_logprobs(model, batch)
    want = torch.cat([plain_logprobs(ref, s.input_ids, 5) for row in rows for s in row])
    torch.testing.assert_close(logp.detach(), want.detach(), atol=ATOL, rtol=0)
    (logp * torch.linspace(0.5, 1.5, len(logp))).sum().backward()
    (want * torch.linspace(0.5, 1.5, len(want))).sum().backward()
    got, exp = sample_grads(model), sample_grads(ref)
    assert_grads_close(got, exp)


@pytest.mark.parametrize("name", NAMES)
def test_shared_prefix_layout_equals_plain_forwards_with_gradients(name):
    """(b) + (c): two groups, prompts of 20 and 27 tokens computed once, completions of 3..33 tokens
    attending to them (windows reach back into the prompt), in one micro-batch; each completion
    token's log-prob (temperature 0.7) and the gradient equal a plain forward of prompt + completion."""
    g = torch.Generator().manual_seed(3)
    prompts = [random_ids(g, 20), random_ids(g, 27)]
    trajs = [Trajectory(prompts[i // 3], random_ids(g, 3 + 6 * i), torch.zeros(3 + 6 * i), i // 3) for i in range(6)]
    (batch,) = make_batches(trajs, pad_id=0, token_budget=10_000)
    model, ref = load_model(name, seed=4), eager_twin(name, seed=4)
    logp, _ = ph.policy_logps(model, batch, 0.7, "none", truncated=False)
    logp.sum().backward()
    total = 0
    for i, t in enumerate(batch.trajectories):
        ids = t.prompt_ids + t.response_ids
        logits = ref(torch.tensor([ids])).logits[0, len(t.prompt_ids) - 1 : -1] / 0.7
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(t.response_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(logp[i, : len(t.response_ids)].detach(), want.detach(), atol=ATOL, rtol=0)
        total = total + want.sum()
    total.backward()
    got, exp = sample_grads(model), sample_grads(ref)
    assert_grads_close(got, exp)


@pytest.mark.parametrize("name", ["tiny-random-gemma2", "tiny-random-mistral", "tiny-random-gemma3"])
def test_decoding_with_a_kv_cache_equals_eager(name):
    """Calls outside the varlen path (generation: a KV cache, one query) go through transformers' mask:
    soft-capped layers through explicit_attention, the others through SDPA; both equal eager."""
    g = torch.Generator().manual_seed(5)
    ids = torch.tensor([random_ids(g, 30)])
    out = []
    for model in (load_model(name, seed=6), eager_twin(name, seed=6)):
        with torch.no_grad():
            first = model(ids, use_cache=True)
            step = model(torch.tensor([[7]]), past_key_values=first.past_key_values, use_cache=True)
        out.append(torch.cat([first.logits[0], step.logits[0]]))
    torch.testing.assert_close(out[0], out[1], atol=1e-5, rtol=1e-5)


def _qkv(n=2, Hq=4, Hkv=2, L=37, D=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(n, h, L, D, generator=g, dtype=dtype, requires_grad=True) for h in (Hq, Hkv, Hkv)]


def _eager_reference(q, k, v, scale, softcap=None, sinks=None, window=None):
    """Transformers' eager attention of one sequence, written out: repeat_kv, scores, cap, mask, sinks."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    L = q.shape[2]
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    ok = (j <= i) & ((i - j < window) if window is not None else True)
    s = s.masked_fill(~ok, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(*s.shape[:3], 1)], -1)
    p = torch.softmax(s, -1)[..., :L]
    return p @ v


@pytest.mark.parametrize("window", [None, 5])
def test_explicit_attention_softcap_sinks_window_and_blocks(window):
    """explicit_attention (the path of soft-capped / sink layers) against the written-out eager formula,
    in one block and in blocks of 7 queries (checkpointed), forward and gradients (fp64)."""
    q, k, v = _qkv()
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    want = _eager_reference(q, k, v, 0.3, softcap=2.0, sinks=sinks, window=window)
    gb = torch.autograd.grad(want.square().sum(), (q, k, v, sinks))
    for budget in (10**9, 2 * 4 * 37 * 7):
        got = attention.explicit_attention(q, k, v, 0.3, softcap=2.0, sinks=sinks, window=window, budget=budget)
        torch.testing.assert_close(got, want.detach())
        ga = torch.autograd.grad(got.square().sum(), (q, k, v, sinks))
        for a, b in zip(ga, gb):
            torch.testing.assert_close(a, b)


def test_varlen_refuses_what_it_cannot_reproduce():
    """A bidirectional module under a shared-prefix layout is refused; with packed segments it falls back
    to the masked eager attention (one notice) and equals it."""
    model = load_model("tiny-random")
    module = model.model.layers[0].self_attn
    q, k, v = (x.float().detach() for x in _qkv(n=1, L=10, D=16))
    layout = (((4, (3, 3)),),)
    with pytest.raises(ValueError, match="bidirectional"):
        attention.varlen_sdpa(module, q, k, v, None, scaling=16**-0.5, layout=layout, is_causal=False)
    with pytest.warns(UserWarning, match="bidirectional"):
        out, _ = attention.varlen_sdpa(module, q, k, v, None, scaling=16**-0.5, segments=[[10]], is_causal=False)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    want = torch.softmax(q @ kk.transpose(-1, -2) * 16**-0.5, -1) @ vv  # no mask: bidirectional
    torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- the head: soft-cap, scale, the model's check


@pytest.mark.parametrize("chunk,n", [(4, 11), (64, 11), (64, 40)])  # row chunks | one kept softmax | column tiles
def test_chunked_logprobs_with_softcap_and_scale_gradcheck(chunk, n, monkeypatch):
    """(d) z = c·tanh(s·(hW + b)/c)/T: values and entropy against the full computation, gradients by
    gradcheck (fp64), on the three paths (several row chunks; the kept softmax, n <= hidden; vocabulary
    tiles of 7 columns)."""
    import posttrain.ops.logprobs as lp

    monkeypatch.setattr(lp, "TILE_MIN", 7 * 40)  # 40 rows -> 7-column tiles over a vocabulary of 30
    monkeypatch.setattr(lp, "TILE_PER_HIDDEN", 0)
    torch.manual_seed(0)
    h, v = 12, 30
    hid = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, h, dtype=torch.float64, requires_grad=True)
    b = torch.randn(v, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, v, (n,))
    kw = dict(temperature=0.8, scale=1.7, softcap=3.0)
    got, ent = chunked_logprobs(hid, w, y, b, chunk=chunk, with_entropy=True, **kw)
    torch.testing.assert_close(got, reference_logprobs(hid, w, y, b, **kw))
    z = torch.tanh(1.7 * (hid @ w.T + b) / 3.0) * 3.0 / 0.8
    p = torch.softmax(z, -1)
    torch.testing.assert_close(ent, -(p * p.log()).sum(-1))
    assert torch.autograd.gradcheck(lambda a, c, d: chunked_logprobs(a, c, y, d, chunk=chunk, **kw)[0], (hid, w, b))


def test_kept_set_logprobs_in_checkpointed_chunks_equal_the_full_computation(monkeypatch):
    """Top-k/top-p behaviour log-probs (kept-set sizes) in row chunks equal trainer_logprobs on the full
    soft-capped logits, values and gradients."""
    import posttrain.ops.logprobs as lp

    monkeypatch.setattr(lp, "TILE_MIN", 30 * 4)  # tiles of 120 logits: chunks of 4 rows over a vocabulary of 30
    monkeypatch.setattr(lp, "TILE_PER_HIDDEN", 0)
    torch.manual_seed(1)
    hid = torch.randn(10, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(30, 6, dtype=torch.float64, requires_grad=True)
    y, kept = torch.randint(0, 30, (10,)), torch.tensor([0, 3, 5, 30, 1, 2, 0, 7, 4, 4])
    got, ent = chunked_kept_logprobs(hid, w, y, kept, temperature=0.9, softcap=2.5, with_entropy=True)
    z = torch.tanh(hid @ w.T / 2.5) * 2.5
    want, want_ent = trainer_logprobs(z, y, 0.9, kept=kept, with_entropy=True)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(ent, want_ent)
    ga = torch.autograd.grad(got.sum(), (hid, w))
    gb = torch.autograd.grad(want.sum(), (hid, w))
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b)


def _small(model_type, **kw):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, bos_token_id=None,
                               eos_token_id=1, **kw)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("model_type,kw", [("cohere", dict(logit_scale=0.0625, tie_word_embeddings=True)),
                                           ("granite", dict(logits_scaling=8.0)),
                                           ("gemma2", dict(final_logit_softcapping=0.5, head_dim=16))])
def test_logit_head_reproduces_scales_and_softcaps_of_other_models(model_type, kw):
    """Cohere multiplies logits by logit_scale, Granite divides by logits_scaling, Gemma 2 soft-caps: the
    head read from the config reproduces the model's own log-probs (and passes the model check)."""
    model = _small(model_type, **kw)
    ids = torch.randint(2, 64, (1, 12))
    with torch.no_grad():
        want = torch.log_softmax(model(ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None]).squeeze(1)
        h = model.model(ids).last_hidden_state[0, :-1]
        got, _ = logit_head(model).logprobs(h, ids[0, 1:])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_a_head_transform_the_config_does_not_name_is_caught():
    """The check runs the model's own forward once: a head without the model's soft-cap, or a forward that
    rescales its logits in code, fails it with a message naming the logits."""
    model = build_tiny("tiny-random-gemma2")
    head = logit_head(model)
    check_logit_head(model, head)  # the right transform passes
    with pytest.raises(UserError, match="logits"):
        check_logit_head(model, LogitHead(head.weight, head.bias, 1.0, None))
    other = build_tiny("tiny-random")
    forward = type(other).forward

    def rescaled(self, *a, **kw):
        out = forward(self, *a, **kw)
        out.logits = out.logits * 1.1
        return out

    other.forward = rescaled.__get__(other)
    with pytest.raises(UserError, match="post-processes its logits"):
        token_logprobs(other, collate([[Tokenized([5, 6, 7, 8], [0, 1, 1, 1])]], 3, packed=True))
