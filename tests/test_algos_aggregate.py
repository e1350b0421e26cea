"""Loss aggregation: hand values per mode, and the micro-batch / data-parallel equivalence with
global normalisers (values and gradients), for every mode."""

import pytest
import torch

import posttrain.algos as A


def test_hand_values():
    loss = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # third row: no loss tokens
    assert A.aggregate(loss, mask, "token_mean").item() == pytest.approx((6 + 4) / 4)
    assert A.aggregate(loss, mask, "seq_mean_token_mean").item() == pytest.approx((2 + 4) / 2)
    assert A.aggregate(loss, mask, "seq_mean_token_sum_norm", max_len=4).item() == pytest.approx((6 / 4 + 4 / 4) / 2)
    assert A.aggregate(loss, mask, "seq_mean_token_sum_norm").item() == pytest.approx((6 / 4 + 4 / 4) / 2)  # T = 4
    assert A.aggregate(loss, mask, "seq_mean_token_sum_norm", max_len=8).item() == pytest.approx((6 / 8 + 4 / 8) / 2)
    with pytest.raises(ValueError, match="token_mean"):
        A.aggregate(loss, mask, "token_sum")


def test_masked_nan_does_not_leak():
    loss = torch.tensor([[1.0, float("nan")]])
    mask = torch.tensor([[1, 0]])
    for mode in A.AGGREGATION_MODES:
        assert A.aggregate(loss, mask, mode, max_len=2).isfinite()


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    B, T = 9, 12
    lengths = torch.tensor([12, 3, 7, 1, 0, 10, 5, 12, 2])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    w = torch.randn(B, T, generator=g, requires_grad=True)  # stand-in for parameters
    return w, mask


def _per_token(w):
    return w ** 2 + w  # any per-token loss


@pytest.mark.parametrize("mode", A.AGGREGATION_MODES)
def test_micro_batches_with_global_normalisers_equal_one_big_batch(mode):
    w, mask = _batch()
    L = 12  # generation limit (constant max length)
    full = A.aggregate(_per_token(w), mask, mode, max_len=L)
    (g_full,) = torch.autograd.grad(full, w)

    n_tok, n_seq = A.loss_token_count(mask), A.sequence_count(mask)  # global normalisers
    total, naive = 0.0, 0.0
    splits = [(0, 4), (4, 5), (5, 9)]  # uneven micro-batches, each trimmed to its own padded length
    for a, b in splits:
        mb_mask = mask[a:b]
        t = max(int(mb_mask.sum(-1).max()), 1)
        mb_loss = _per_token(w[a:b, :t])
        total = total + A.aggregate(mb_loss, mb_mask[:, :t], mode, norm_tokens=n_tok, num_sequences=n_seq, max_len=L)
        naive = naive + A.aggregate(mb_loss, mb_mask[:, :t], mode, max_len=L) / len(splits)
    (g_micro,) = torch.autograd.grad(total, w, retain_graph=True)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(g_micro, g_full)
    # averaging local aggregates (no global normalisers) is NOT the big-batch loss here
    assert abs(naive.item() - full.item()) > 1e-3


def test_data_parallel_ranks_sum_to_global():
    """Each rank aggregates its shard with global normalisers; the sum over ranks (what a SUM
    all-reduce or world_size × a MEAN all-reduce gives) is the single-process loss."""
    w, mask = _batch(1)
    full = A.aggregate(_per_token(w), mask, "token_mean")
    n_tok = A.loss_token_count(mask)
    shards = [slice(0, 3), slice(3, 6), slice(6, 9)]
    ranks = [A.aggregate(_per_token(w[s]), mask[s], "token_mean", norm_tokens=n_tok) for s in shards]
    mean_allreduce = sum(ranks) / len(ranks)
    torch.testing.assert_close(mean_allreduce * len(ranks), full)


def test_micro_batch_without_loss_tokens_is_zero_not_nan():
    loss = torch.ones(2, 3)
    mask = torch.zeros(2, 3)
    for mode in A.AGGREGATION_MODES:
        assert A.aggregate(loss, mask, mode).item() == 0.0
