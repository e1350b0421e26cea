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

Devices: the same code runs on CPU and CUDA (index_select, causal SDPA). On CUDA the per-bucket
causal calls can use the flash / memory-efficient kernels, which SDPA with a block-diagonal mask
cannot; only the compute dtype is chosen by device (`attention_dtypes`). The bucket plan is built
once per set of segment lengths on the CPU and cached on the tensors' device; reading the segments
(`position_ids.tolist()`) is one device sync per forward, not per layer.
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


def varlen_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, segments=None,
                layout=None, **kwargs):
    """query (B, Hq, T, D), key/value (B, Hkv, T, D) -> (B, T, Hq, D), None (the transformers contract).

    `segments` (per row, segment lengths) or `layout` (per row, shared-prefix blocks; see `Layout`)
    select the varlen path. Tokens move with index_select (backward: one index_add per bucket), never
    by slicing, whose backward would allocate a full-size zero gradient per slice.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if layout is None and segments is not None:
        layout = tuple(tuple((L, ()) for L in segs) for segs in segments)
    if layout is None or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    gqa = query.shape[1] != key.shape[1]
    compute, out_dtype = attention_dtypes(query.device, query.dtype, key.dtype, value.dtype)
    query, key, value = query.to(compute), key.to(compute), value.to(compute)

    def attend(q, k, v):
        with torch.autocast(q.device.type, enabled=False):  # autocast would cast fp32 inputs back to bf16
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, dropout_p=dropout, enable_gqa=gqa)

    if all(len(row) == 1 and not row[0][1] for row in layout):  # one plain sample per row: plain causal SDPA
        return attend(query, key, value).transpose(1, 2).contiguous().to(out_dtype), None
    B, Hq, T, D = query.shape
    flat = [x.transpose(1, 2).reshape(B * T, x.shape[1], D) for x in (query, key, value)]  # token-major (B*T, H, D)
    buckets, inverse = _plan(tuple(layout), T, query.device)
    outs = []
    for idx, n, Lb, keep in buckets:
        q, k, v = (x.index_select(0, idx).view(n, Lb, x.shape[1], D).transpose(1, 2) for x in flat)
        o = attend(q, k, v).transpose(1, 2).reshape(n * Lb, Hq, D)
        outs.append(o.index_select(0, keep))  # drop padding rows and the repeated prefix rows
    out = torch.cat(outs).index_select(0, inverse)  # back to token order (B*T, Hq, D)
    return out.view(B, T, Hq, D).to(out_dtype), None


# A row's layout: blocks laid end to end, each (P, (C_1, ..., C_n)): a prefix of P tokens followed by
# n continuations of C_i tokens that each see the prefix and themselves, never each other (a group's
# prompt once, then its G completions). n = 0 is an ordinary packed sample of P tokens. The blocks
# tile the row's T positions (the padding tail is merged into the last block's last piece).
Layout = tuple  # tuple over rows of tuple of (P, tuple[int, ...])


def _virtual_segments(layout: Layout, T: int) -> list[tuple[list[int], int]]:
    """Every attention task as (token indices into the flat (B*T) order, outputs kept from offset).

    A prefix is one causal segment (all outputs kept). Continuation i becomes the causal segment
    prefix + C_i whose first P outputs are dropped: its queries see the prefix's keys, which are
    gathered again (in backward their gradients add up over the continuations)."""
    segs = []
    for b, row in enumerate(layout):
        start = b * T
        for P, conts in row:
            prefix = list(range(start, start + P))
            segs.append((prefix, 0))
            start += P
            for C in conts:
                segs.append((prefix + list(range(start, start + C)), P))
                start += C
        if start != (b + 1) * T:
            raise ValueError(f"layout of row {b} covers {start - b * T} of {T} positions")
    return segs


def attention_dtypes(device: torch.device, *dtypes: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(dtype SDPA computes in, dtype returned) for q/k/v of `dtypes`, chosen by their device.

    Under autocast q/k arrive fp32 (RoPE with fp32 cos/sin) and v bf16, and SDPA (run with autocast
    off) needs one dtype. CPU: fp32 -- CPU flash attention's backward is ~4x slower in bf16 than in
    fp32 (torch 2.13, AMX Xeon: 0.96 s vs 0.22 s per SmolLM2 step) and attention FLOPs are small --
    returning bf16 (other dtypes stay as they are). CUDA (and other accelerators): the 16-bit dtype
    among them, what autocast would pick, so the flash / memory-efficient kernels (16-bit only) run;
    uniform dtypes stay as they are.
    """
    if torch.device(device).type == "cpu":
        return (torch.float32, torch.bfloat16) if torch.bfloat16 in dtypes else (dtypes[0], dtypes[0])
    half = next((d for d in (torch.bfloat16, torch.float16) if d in dtypes), dtypes[0])
    return half, half


@functools.lru_cache(maxsize=64)
def _plan(layout: Layout, T: int, device: torch.device = torch.device("cpu"), ratio: float = 0.75):
    """Group the attention tasks of all rows into padded batches of similar length.

    Longest first; a bucket takes tasks down to `ratio` x its longest, so a task's padded attention
    work stays within 1/ratio^2 of its real work. Per bucket: idx (n*Lb,) the token behind each padded
    position (padding repeats the task's last token: it sits after every real query of the task, so
    causal attention never shows it to a real query, and its own outputs are dropped), n, Lb, keep
    (m,) the rows of the (n*Lb) output that are kept. `inverse` puts the concatenated kept rows back in
    token order. Cached: every layer of a forward asks for the same plan.
    """
    segs = _virtual_segments(layout, T)
    by_len = sorted(range(len(segs)), key=lambda i: -len(segs[i][0]))
    buckets, dest = [], []
    i = 0
    while i < len(by_len):
        Lb = len(segs[by_len[i]][0])
        j = i
        while j < len(by_len) and len(segs[by_len[j]][0]) >= ratio * Lb:
            j += 1
        idx, keep = [], []
        for r, m in enumerate(by_len[i:j]):
            tokens, skip = segs[m]
            idx += tokens + [tokens[-1]] * (Lb - len(tokens))
            keep += range(r * Lb + skip, r * Lb + len(tokens))
            dest += tokens[skip:]
        buckets.append((torch.tensor(idx, device=device), j - i, Lb, torch.tensor(keep, device=device)))
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
