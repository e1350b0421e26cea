"""Attention over packed rows, computed sample by sample (varlen) instead of with a (T, T) mask.

A packed row of T tokens holding samples of lengths L_1..L_k needs Σ L_i² / 2 attention scores, but
SDPA with a block-diagonal mask computes all T² and masks most of them (and cannot use the causal
fast path). Here the segments of all rows are gathered (one index_select per bucket of similar
lengths) into a padded batch and run through one causal SDPA per bucket, then scattered back: a few
calls per layer instead of one per sample, and no cross-sample scores. Segments come from position ids
(a new segment wherever position 0 appears), which is exactly how our collate lays out both packed
and right-padded rows, so the result equals the masked computation (tested).

The function is registered with transformers as the attention implementation `posttrain_sdpa`. It
takes the varlen path only when the caller passes `segments=` (our trainer's forward does); every
other call (generation with a KV cache, left-padded batches) falls through to the stock SDPA.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

NAME = "posttrain_sdpa"


def segments_from_positions(position_ids: torch.Tensor, row_tokens: list[int] | None = None) -> list[list[int]]:
    """(B, T) position ids -> per row, the lengths of its segments (they sum to T).

    A segment starts wherever position 0 appears among the row's real tokens; the padding tail
    (from `row_tokens[b]` on) is merged into the last segment, which is safe under causal attention:
    real tokens never look ahead, and outputs at padded positions carry no loss.
    """
    out = []
    T = position_ids.shape[1]
    for b, row in enumerate(position_ids.tolist()):
        real = T if row_tokens is None else row_tokens[b]
        starts = [t for t in range(real) if row[t] == 0] or [0]
        if starts[0] != 0:
            starts = [0] + starts
        ends = starts[1:] + [T]
        out.append([e - s for s, e in zip(starts, ends)])
    return out


def varlen_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, segments=None, **kwargs):
    """query (B, Hq, T, D), key/value (B, Hkv, T, D) -> (B, T, Hq, D), None (the transformers contract).

    Tokens move with index_select (backward: one index_add per bucket), never by slicing, whose
    backward would allocate a full-size zero gradient per slice.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if segments is None or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    gqa = query.shape[1] != key.shape[1]
    out_dtype = query.dtype
    if query.device.type == "cpu" and torch.bfloat16 in (query.dtype, key.dtype, value.dtype):
        # Under autocast q/k arrive fp32 (RoPE with fp32 cos/sin) and v bf16. CPU flash attention's
        # backward is ~4x slower in bf16 than in fp32 (torch 2.13, AMX Xeon: 0.96 s vs 0.22 s per
        # SmolLM2 step) and attention FLOPs are small, so it runs in fp32 and returns bf16.
        out_dtype = torch.bfloat16
        query, key, value = query.float(), key.float(), value.float()

    def attend(q, k, v):
        with torch.autocast(q.device.type, enabled=False):  # autocast would cast fp32 inputs back to bf16
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, dropout_p=dropout, enable_gqa=gqa)

    if all(len(segs) == 1 for segs in segments):  # one sample per row (padded batches): plain causal SDPA
        return attend(query, key, value).transpose(1, 2).contiguous().to(out_dtype), None
    B, Hq, T, D = query.shape
    flat = [x.transpose(1, 2).reshape(B * T, x.shape[1], D) for x in (query, key, value)]  # token-major (B*T, H, D)
    buckets, inverse = _plan(tuple(L for segs in segments for L in segs), query.device)
    outs = []
    for idx, n, Lb, keep in buckets:
        q, k, v = (x.index_select(0, idx).view(n, Lb, x.shape[1], D).transpose(1, 2) for x in flat)
        o = attend(q, k, v).transpose(1, 2).reshape(n * Lb, Hq, D)
        outs.append(o.index_select(0, keep))  # drop the padding rows
    out = torch.cat(outs).index_select(0, inverse)  # back to token order (B*T, Hq, D)
    return out.view(B, T, Hq, D).to(out_dtype), None


@functools.lru_cache(maxsize=64)
def _plan(lengths: tuple[int, ...], device: torch.device = torch.device("cpu"), ratio: float = 0.75):
    """Group the segments of all rows (lengths in token order; they tile B*T) into padded batches.

    Longest first; a bucket takes segments down to `ratio` x its longest, so a segment's padded
    attention work stays within 1/ratio^2 of its real work. Per bucket: idx (n*Lb,) the token behind
    each padded position (padding repeats the segment's last token: it sits after every real query
    of the segment, so causal attention never shows it to a real query, and its own outputs are
    dropped), n, Lb, keep (m,) the rows of the (n*Lb) output that are real. `inverse` puts the
    concatenated kept rows back in token order. Cached: every layer of a forward asks for the same plan.
    """
    starts = [0]
    for L in lengths[:-1]:
        starts.append(starts[-1] + L)
    by_len = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    buckets, dest = [], []
    i = 0
    while i < len(by_len):
        Lb = lengths[by_len[i]]
        j = i
        while j < len(by_len) and lengths[by_len[j]] >= ratio * Lb:
            j += 1
        members = by_len[i:j]
        ar = torch.arange(Lb)
        idx = torch.cat([starts[m] + ar.clamp(max=lengths[m] - 1) for m in members])
        keep = torch.cat([ar[: lengths[m]] + r * Lb for r, m in enumerate(members)])
        dest += [starts[m] + t for m in members for t in range(lengths[m])]
        buckets.append((idx.to(device), len(members), Lb, keep.to(device)))
        i = j
    return buckets, torch.argsort(torch.tensor(dest)).to(device)


_installed = False


def install() -> str:
    """Register the implementation with transformers (idempotent); returns its name."""
    global _installed
    if not _installed:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        AttentionInterface.register(NAME, varlen_sdpa)
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # fallback calls still get the usual mask
        _installed = True
    return NAME
