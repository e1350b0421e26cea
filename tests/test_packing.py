import random

import pytest
import torch

from conftest import conv
from posttrain.data.packing import IGNORE, collate, pack_groups
from posttrain.data.templates import render_messages
from posttrain.models.forward import token_logprobs
from posttrain.models.loading import load_model


def test_pack_groups_fit_and_cover():
    rng = random.Random(0)
    lengths = [rng.randint(1, 100) for _ in range(200)]
    groups = pack_groups(lengths, 128)
    assert sorted(i for g in groups for i in g) == list(range(200))
    assert all(sum(lengths[i] for i in g) <= 128 for g in groups)
    lower_bound = -(-sum(lengths) // 128)
    assert len(groups) <= lower_bound * 1.1 + 1  # best-fit decreasing is near optimal


def test_pack_groups_refuses_oversize():
    with pytest.raises(ValueError):
        pack_groups([5, 200], 128)


def samples(tok):
    return [render_messages(tok, conv(f"What is {i} + {i}?", f"{i} + {i} = {2 * i}" + " ok" * i)["messages"]) for i in range(1, 6)]


def test_targets_are_shifted_and_never_cross_samples(tiny_tok):
    s = samples(tiny_tok)
    b = collate([s[:3]], tiny_tok.pad_token_id, packed=True)
    starts = [0, len(s[0]), len(s[0]) + len(s[1])]
    assert b.position_ids[0, starts].tolist() == [0, 0, 0]
    for k, st in enumerate(starts):
        end = st + len(s[k])
        assert b.targets[0, end - 1] == IGNORE  # the last token of a sample predicts nothing
        for t in range(st, end - 1):
            expected = s[k].input_ids[t - st + 1] if s[k].loss_mask[t - st + 1] else IGNORE
            assert b.targets[0, t] == expected


def test_packed_equals_padded_loss(tiny_tok):
    torch.manual_seed(0)
    model = load_model("tiny-random")
    s = samples(tiny_tok)
    packed = collate([s], tiny_tok.pad_token_id, packed=True)  # one row, five samples
    padded = collate([[x] for x in s], tiny_tok.pad_token_id, packed=False)  # five padded rows
    assert packed.num_padding == 0 and padded.num_padding > 0
    with torch.no_grad():
        lp_packed, _ = token_logprobs(model, packed)
        lp_padded, _ = token_logprobs(model, padded)
    assert lp_packed.shape == lp_padded.shape
    torch.testing.assert_close(lp_packed, lp_padded, atol=1e-5, rtol=1e-5)
    # and the packed row must differ from a naive concatenation without position restarts
    naive = collate([s], tiny_tok.pad_token_id, packed=True)
    naive.position_ids = torch.arange(naive.input_ids.shape[1])[None]
    with torch.no_grad():
        lp_naive, _ = token_logprobs(model, naive)
    assert (lp_naive - lp_packed).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["tiny-random", "tiny-random-qwen2"])
def test_varlen_attention_equals_masked_sdpa_with_gradients(tiny_tok, name):
    s = samples(tiny_tok)
    packed = collate([s[:3], s[3:]], tiny_tok.pad_token_id, packed=True)  # two rows, the second padded
    results = []
    for varlen in (False, True):
        model = load_model(name, varlen_attention=varlen)
        logp, _ = token_logprobs(model, packed)
        logp.sum().backward()
        results.append((logp.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_segments_merge_padding_tail():
    from posttrain.ops.attention import segments_from_positions

    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 0, 1, 2]])
    assert segments_from_positions(pos, [5, 4]) == [[3, 4], [7]]
    assert segments_from_positions(pos) == [[3, 2, 2], [4, 3]]


def test_bf16_autocast_is_close_to_fp32_and_keeps_the_head_fp32(tiny_tok):
    """mixed_precision=bf16: backbone matmuls in bf16, residual stream and lm_head fp32. Log-probs
    stay within bf16 rounding of fp32 (and far from a bf16 head's error); gradients land in fp32."""
    from posttrain.models.forward import compute_precision

    s = samples(tiny_tok)
    packed = collate([s[:3], s[3:]], tiny_tok.pad_token_id, packed=True)
    out = {}
    for mp in ("none", "bf16"):
        model = load_model("tiny-random")
        logp, _ = token_logprobs(model, packed, mixed_precision=mp)
        logp.sum().backward()
        out[mp] = (logp.detach(), [p.grad for p in model.parameters()])
    lp32, lp16 = out["none"][0], out["bf16"][0]
    assert lp16.dtype == torch.float32 and all(g.dtype == torch.float32 for g in out["bf16"][1])
    diff = (lp32 - lp16).abs().max().item()
    assert 0 < diff < 0.05, diff  # bf16 matmuls change something, but only by rounding
    for g32, g16 in zip(out["none"][1], out["bf16"][1]):
        assert torch.nn.functional.cosine_similarity(g32.flatten(), g16.flatten(), dim=0) > 0.98
    with pytest.raises(ValueError, match="mixed_precision"):
        compute_precision("fp8", "cpu")


def test_varlen_attention_runs_fp32_under_cpu_autocast(tiny_tok):
    """CPU bf16 flash-attention backward is slow: varlen_sdpa upcasts, attends in fp32, returns bf16."""
    from posttrain.ops.attention import varlen_sdpa

    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 10, 8, requires_grad=True), torch.randn(1, 2, 10, 8, requires_grad=True)
    v = torch.randn(1, 2, 10, 8).bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, _ = varlen_sdpa(None, q, k, v, None, scaling=8 ** -0.5, segments=[[6, 4]])
    assert o.dtype == torch.bfloat16 and o.shape == (1, 10, 4, 8)
    ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        a, b, c, is_causal=True, scale=8 ** -0.5, enable_gqa=True) for a, b, c in
        zip(q.split([6, 4], 2), k.split([6, 4], 2), v.float().split([6, 4], 2))], 2).transpose(1, 2)
    torch.testing.assert_close(o.float(), ref, atol=1e-2, rtol=1e-2)  # only the bf16 output rounding
    o.float().sum().backward()
    assert q.grad is not None and v.grad.dtype == torch.bfloat16


def test_bucket_plan_covers_every_token_once_and_bounds_padding():
    from posttrain.ops.attention import _plan

    lengths = (5, 100, 3, 80, 77, 1, 64, 30)
    buckets, inverse = _plan((tuple((L, ()) for L in lengths),), sum(lengths))
    kept = torch.cat([b.q_idx[b.keep] for b in buckets])
    assert torch.equal(kept[inverse], torch.arange(sum(lengths)))  # each token exactly once, back in order
    for b in buckets:
        assert b.mask is None and b.q_idx is b.kv_idx and b.Lq == b.Lk
        assert b.keep.numel() >= b.n * b.Lk * 0.75 ** 2 * 0.5  # padding bounded (ratio 0.75 per segment)
    assert len(buckets) < len(lengths)


def test_shared_prefix_plan_computes_each_query_once():
    """A group [prompt P][C_1]...[C_G]: the prompt's queries once, each continuation's C_i queries over its
    P + C_i keys (never the prompt's queries again), the mask causal from the continuation's offset."""
    from posttrain.ops.attention import _plan

    layout = (((6, (3, 5, 1)), (4, (2, 2))), ((9, ()), (2, (12,))))  # two rows of T = 23: groups, a plain sample
    T = 23
    buckets, inverse = _plan(layout, T)
    kept = torch.cat([b.q_idx[b.keep] for b in buckets])
    assert torch.equal(kept[inverse], torch.arange(2 * T))
    queries = sum(b.n * b.Lq for b in buckets)
    empty = _plan((((5, (3, 0, 2)),),), 10)[0]  # an empty continuation: no task, nothing else changes
    assert sum(int(b.keep.numel()) for b in empty) == 10
    assert queries < 2 * T + 2 * 10  # padding only: no prompt query repeated per continuation
    for b in (b for b in buckets if b.mask is not None):
        q = b.q_idx.view(b.n, b.Lq)
        k = b.kv_idx.view(b.n, b.Lk)
        for r in range(b.n):  # query i sees exactly the keys up to its own token (flat indices grow with position)
            for i in range(b.Lq):
                seen = k[r][b.mask[r, 0, i]]
                assert seen.max() == q[r, i] and torch.equal(seen, k[r][: seen.numel()])  # prefix + own tokens so far
