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
