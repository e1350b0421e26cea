"""Attention over packed rows, computed sample by sample (varlen) instead of with a (T, T) mask.

A packed row of T tokens holding samples of lengths L_1..L_k needs Σ L_i² / 2 attention scores, but
SDPA with a block-diagonal mask computes all T² and masks most of them (and cannot use the causal
fast path). Here each segment [s, e) runs its own causal SDPA. Segments come from position ids
(a new segment wherever position 0 appears), which is exactly how our collate lays out both packed
and right-padded rows, so the result equals the masked computation (tested).

The function is registered with transformers as the attention implementation `posttrain_sdpa`. It
takes the varlen path only when the caller passes `segments=` (our trainer's forward does); every
other call (generation with a KV cache, left-padded batches) falls through to the stock SDPA.
"""

from __future__ import annotations

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

    Rows are taken apart with unbind/split (whose backward is one stack/cat), not by slicing, which
    would allocate a full-size zero gradient per slice.
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
    rows = []
    for q, k, v, segs in zip(query.unbind(0), key.unbind(0), value.unbind(0), segments):
        if len(segs) == 1:
            rows.append(attend(q[None], k[None], v[None])[0])
            continue
        parts = zip(q.split(segs, dim=1), k.split(segs, dim=1), v.split(segs, dim=1))
        rows.append(torch.cat([attend(a[None], b[None], c[None])[0] for a, b, c in parts], dim=1))  # (Hq, T, D)
    return torch.stack(rows).transpose(1, 2).contiguous().to(out_dtype), None


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
