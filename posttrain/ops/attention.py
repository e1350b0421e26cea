"""Attention over packed rows, computed sample by sample (varlen) instead of with a (T, T) mask.

A packed row of T tokens holding samples of lengths L_1..L_k needs Σ L_i² / 2 attention scores, but
SDPA with a block-diagonal mask computes all T² and masks most of them (and cannot use the causal
fast path). Here the segments of all rows are gathered (one index_select per bucket of similar
lengths) into a padded batch and run through one causal SDPA per bucket, then scattered back: a few
calls per layer instead of one per sample, and no cross-sample scores. Segments come from position ids
(a new segment wherever position 0 appears), which is exactly how our collate lays out both packed
and right-padded rows, so the result equals the masked computation (tested).

A shared-prefix layout (a group's prompt once, then its completions, each seeing the prompt and itself)
has two kinds of tasks: the prompt, plain causal; and each completion, whose C queries attend over the
prompt's keys and its own (P + C keys, gathered per completion), with a boolean mask from the query's
offset; the prompt's queries are never recomputed per completion (`_plan`, `Bucket`).

Every task's keys start at index 0 of its bucket row, so what a layer adds to plain causal
attention is computed per task, exactly as transformers does it for one sequence:
- `sliding_window` W (Mistral, Gemma 2/3 local layers, Qwen2 with use_sliding_window): key j is
  visible to query i iff j <= i and i - j < W (transformers' masking_utils.sliding_window_overlay),
  positions counted within the sample; a shared-prefix continuation's positions follow its prefix.
  SDPA with a (L, L) boolean mask of that band per bucket.
- `softcap` c (Gemma 2's attn_logit_softcapping): scores s = c·tanh(s/c) before the mask, and
  `s_aux` (gpt-oss's per-head sinks: one extra logit in each softmax's normaliser). SDPA has
  neither, so those layers run `explicit_attention`: blocks of queries, each block recomputed in
  backward (checkpointed), so at most ATTN_BUDGET scores are alive at once.
- Any other argument a decoder passes (position_bias, flash-attention's cu_seq_lens, a
  bidirectional module) is not reproduced: packed rows fall back to the model's own eager
  attention over transformers' packed-sequence mask (exact, one notice), and a shared-prefix layout,
  which no (T, T) mask from position ids can express, is refused.

The function is registered with transformers as the attention implementation `posttrain_varlen`
(no "sdpa" in the name: transformers refuses any "*sdpa*" implementation for models that declare
no SDPA support, e.g. Gemma 2, whose soft-capping this file implements). It takes the varlen path
only when the caller passes `segments=` or `layout=` (our trainer's forward does); every other call
(generation with a KV cache, left-padded batches) goes to the stock SDPA, or to
`explicit_attention` over transformers' mask for soft-capped / sink layers.

Devices: the same code runs on CPU and CUDA (index_select, causal SDPA). On CUDA the per-bucket
causal calls can use the flash / memory-efficient kernels, which SDPA with a block-diagonal mask
cannot; only the compute dtype is chosen by device (`attention_dtypes`). The bucket plan is built
once per set of segment lengths on the CPU and cached on the tensors' device; reading the segments
(`position_ids.tolist()`) is one device sync per forward, not per layer.
"""

from __future__ import annotations

import functools
import sys
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

NAME = "posttrain_varlen"
ATTN_BUDGET = 2**24  # scores (64 MB in fp32) one block of `explicit_attention` may hold

# arguments decoders pass that do not change what attention computes (use_cache: the cache was applied
# before the call; output_attentions: we return no weights, as SDPA does)
_NEUTRAL = frozenset({"position_ids", "use_cache", "cache_position", "output_attentions"})


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
                layout=None, sliding_window=None, softcap=None, s_aux=None, is_causal=None, **kwargs):
    """query (B, Hq, T, D), key/value (B, Hkv, T, D) -> (B, T, Hq, D), None (the transformers contract).

    `segments` (per row, segment lengths) or `layout` (per row, shared-prefix blocks; see `Layout`)
    select the varlen path. Tokens move with index_select (backward: one index_add per bucket), never
    by slicing, whose backward would allocate a full-size zero gradient per slice.
    """
    extra = {k: v for k, v in kwargs.items() if v is not None and k not in _NEUTRAL}
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    spec = dict(dropout=dropout, scaling=scaling, window=sliding_window, softcap=softcap, sinks=s_aux)
    shared_prefix = layout is not None
    if layout is None and segments is not None:
        layout = tuple(tuple((L, ()) for L in segs) for segs in segments)
    if layout is None or query.shape[2] != key.shape[2]:
        return fallback_attention(module, query, key, value, attention_mask, causal, extra, **spec)
    refusal = ("bidirectional attention" if not causal else
               f"attention arguments {sorted(extra)}" if extra else None)
    if refusal is not None:
        if shared_prefix:
            raise ValueError(f"posttrain's varlen attention cannot reproduce the {refusal} of "
                             f"{type(module).__name__}, and a shared-prefix layout has no exact fallback")
        notice(f"posttrain: {type(module).__name__} passes {refusal}, which the varlen path does not reproduce; "
               "packed rows use the model's eager attention over transformers' packed-sequence mask")
        return fallback_attention(module, query, key, value, attention_mask, causal, extra, **spec)
    compute, out_dtype = attention_dtypes(query.device, query.dtype, key.dtype, value.dtype)
    query, key, value = query.to(compute), key.to(compute), value.to(compute)
    attend = functools.partial(causal_attention, **spec)
    if all(len(row) == 1 and not row[0][1] for row in layout):  # one plain sample per row: plain causal attention
        return attend(query, key, value).transpose(1, 2).contiguous().to(out_dtype), None
    B, Hq, T, D = query.shape
    flat = [x.transpose(1, 2).reshape(B * T, x.shape[1], D) for x in (query, key, value)]  # token-major (B*T, H, D)
    buckets, inverse = _plan(tuple(layout), T, query.device, window=sliding_window)
    outs = []
    for b in buckets:
        q = flat[0].index_select(0, b.q_idx).view(b.n, b.Lq, Hq, D).transpose(1, 2)
        k, v = (x.index_select(0, b.kv_idx).view(b.n, b.Lk, x.shape[1], D).transpose(1, 2) for x in flat[1:])
        o = attend(q, k, v, mask=b.mask).transpose(1, 2).reshape(b.n * b.Lq, Hq, D)
        outs.append(o.index_select(0, b.keep))  # drop the padding rows
    out = torch.cat(outs).index_select(0, inverse)  # back to token order (B*T, Hq, D)
    return out.view(B, T, Hq, D).to(out_dtype), None


# A row's layout: blocks laid end to end, each (P, (C_1, ..., C_n)): a prefix of P tokens followed by
# n continuations of C_i tokens that each see the prefix and themselves, never each other (a group's
# prompt once, then its G completions). n = 0 is an ordinary packed sample of P tokens. The blocks
# tile the row's T positions (the padding tail is merged into the last block's last piece).
Layout = tuple  # tuple over rows of tuple of (P, tuple[int, ...])


def _virtual_segments(layout: Layout, T: int) -> list[tuple[list[int], int]]:
    """Every attention task as (token indices into the flat (B*T) order, index of its first query).

    A prefix is one causal segment (every token a query, from 0). Continuation i is the keys
    prefix + C_i with only its own C_i tokens as queries (from P): they see the prefix's keys, which are
    gathered again for each continuation (in backward their gradients add up over the continuations);
    the prefix's queries are never computed twice."""
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


class Bucket(NamedTuple):
    """A padded batch of n attention tasks: queries q_idx (n*Lq,) and keys/values kv_idx (n*Lk,) as indices
    into the flat token order; `mask` (n, 1, Lq, Lk) bool (True = attend) for tasks whose queries start
    after key 0 (continuations), None for plain causal tasks (Lq = Lk, q_idx is kv_idx); `keep` (m,) the
    real rows of the (n*Lq) outputs."""

    q_idx: torch.Tensor
    kv_idx: torch.Tensor
    n: int
    Lq: int
    Lk: int
    mask: torch.Tensor | None
    keep: torch.Tensor


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
def _plan(layout: Layout, T: int, device: torch.device = torch.device("cpu"), ratio: float = 0.75,
          window: int | None = None):
    """Group the attention tasks of all rows into padded batches of similar size -> (buckets, inverse).

    Plain causal tasks (queries from key 0) and continuations (queries from P) go to separate buckets,
    each sorted longest first; a bucket takes tasks down to `ratio` x its longest, so a task's padded work
    stays within 1/ratio^2 of its real work. Padding repeats a task's last key and last query: the
    repeated key sits after every real query, so no real query sees it (causal), and the repeated
    query's outputs are dropped. `window`: the sliding window folded into a continuation's mask
    (plain causal buckets get it from `causal_attention`). `inverse` puts the concatenated kept rows
    back in token order. Cached: every layer of a forward asks for the same plan.
    """
    segs = [s for s in _virtual_segments(layout, T) if len(s[0]) > s[1]]  # an empty continuation has no query
    buckets, dest = [], []
    for continuation in (False, True):
        tasks = sorted((s for s in segs if bool(s[1]) == continuation), key=lambda s: -len(s[0]))
        i = 0
        while i < len(tasks):
            j = i
            while j < len(tasks) and len(tasks[j][0]) >= ratio * len(tasks[i][0]):
                j += 1
            buckets.append(_bucket(tasks[i:j], device, continuation, window))
            dest += [t for tokens, skip in tasks[i:j] for t in tokens[skip:]]
            i = j
    return buckets, torch.argsort(torch.tensor(dest)).to(device)


def _bucket(tasks: list[tuple[list[int], int]], device, continuation: bool, window: int | None) -> Bucket:
    """One padded batch of tasks (token indices, first query); see `_plan`."""
    n, Lk = len(tasks), len(tasks[0][0])
    Lq = max(len(tokens) - skip for tokens, skip in tasks)
    kv, q, keep, qpos = [], [], [], []
    for r, (tokens, skip) in enumerate(tasks):
        queries = tokens[skip:]
        kv += tokens + [tokens[-1]] * (Lk - len(tokens))
        q += queries + [queries[-1]] * (Lq - len(queries))
        keep += range(r * Lq, r * Lq + len(queries))
        qpos.append([skip + min(i, len(queries) - 1) for i in range(Lq)])  # key position of each query row
    kv_idx = torch.tensor(kv, device=device)
    if not continuation:
        return Bucket(kv_idx, kv_idx, n, Lk, Lk, None, torch.tensor(keep, device=device))
    qp = torch.tensor(qpos, device=device)[:, None, :, None]  # (n, 1, Lq, 1)
    kj = torch.arange(Lk, device=device)[None, None, None, :]
    mask = (kj <= qp) & (qp - kj < window) if window is not None else kj <= qp
    return Bucket(torch.tensor(q, device=device), kv_idx, n, Lq, Lk, mask, torch.tensor(keep, device=device))


def causal_attention(q, k, v, dropout=0.0, scaling=None, window=None, softcap=None, sinks=None,
                     mask=None) -> torch.Tensor:
    """Causal attention of tasks that start at index 0: q (n, Hq, L, D), k/v (n, Hkv, L, D) -> (n, Hq, L, D);
    or, with `mask` (n, 1, Lq, Lk) bool (True = attend; the window already in it), queries q (n, Hq, Lq, D)
    over keys k/v (n, Hkv, Lk, D) as the mask says.

    SDPA (causal flag, the sliding-window band or the mask as a boolean mask) unless the layer soft-caps its
    scores or has sinks: then `explicit_attention`. Autocast is off: it would cast fp32 inputs back to bf16."""
    gqa = q.shape[1] != k.shape[1]
    with torch.autocast(q.device.type, enabled=False):
        if softcap is not None or sinks is not None:
            return explicit_attention(q, k, v, scaling, softcap=softcap, sinks=sinks, window=window, mask=mask,
                                      dropout=dropout)
        L = q.shape[2]
        if mask is None and (window is None or window >= L):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, dropout_p=dropout, enable_gqa=gqa)
        if mask is None:
            mask = band_mask(L, L, window, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, dropout_p=dropout, enable_gqa=gqa)


def band_mask(Lq: int, Lk: int, window: int | None, device, first: int = 0, key_first: int = 0) -> torch.Tensor:
    """(Lq, Lk) bool, True where a query sees a key: query i sits at position first + i, key j at key_first + j;
    visible iff key position <= query position and, with a window W, query position - key position < W."""
    qi = torch.arange(first, first + Lq, device=device)[:, None]
    kj = torch.arange(key_first, key_first + Lk, device=device)[None, :]
    ok = kj <= qi
    return ok & (qi - kj < window) if window is not None else ok


def explicit_attention(q, k, v, scaling=None, softcap=None, sinks=None, window=None, mask=None, dropout=0.0,
                       budget: int = ATTN_BUDGET) -> torch.Tensor:
    """Attention with what SDPA lacks, q (n, Hq, Lq, D), k/v (n, Hkv, Lk, D) -> (n, Hq, Lq, D):

        s = q·kᵀ·scale;  s = c·tanh(s/c) (softcap c);  masked;  p = softmax([s, sink_h]) without the sink column;  p·v

    as transformers' eager attention of Gemma 2 (soft-cap) and gpt-oss (sinks, `s_aux`) computes it.
    `mask` None: causal, query i at key position i + Lk - Lq (the last keys), and with `window` W key
    j visible iff that position - j < W. Else `mask` (4-d, broadcastable to (n, Hq, Lq, Lk)): bool
    (True = attend) or additive. Queries run in blocks of at most `budget` scores, each block a
    checkpoint when gradients are needed (its scores are recomputed in backward, never all stored),
    and without a mask each block reads only the keys it can see."""
    n, Hq, Lq, _ = q.shape
    Lk = k.shape[2]
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    block = max(1, min(Lq, budget // max(1, n * Hq * Lk)))
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    outs = []
    for a, qb in zip(range(0, Lq, block), q.split(block, 2)):
        c = qb.shape[2]
        if mask is None:
            first = a + Lk - Lq  # key position of the block's first query
            lo, hi = (max(0, first - window + 1) if window is not None else 0), first + c
            allowed = band_mask(c, hi - lo, window, q.device, first=first, key_first=lo)
        else:
            lo, hi = 0, Lk
            allowed = mask[:, :, a : a + c]
        fn = functools.partial(_attention_block, scale=scale, softcap=softcap, sinks=sinks, allowed=allowed, dropout=dropout)
        kb, vb = k[:, :, lo:hi], v[:, :, lo:hi]
        outs.append(checkpoint(fn, qb, kb, vb, use_reentrant=False) if grad else fn(qb, kb, vb))
    return torch.cat(outs, 2)


def _attention_block(q, k, v, scale, softcap, sinks, allowed, dropout):
    """One block of `explicit_attention`: q (n, Hq, c, D), k/v (n, Hkv, L, D), allowed (bool or additive,
    broadcastable to (n, Hq, c, L)) -> (n, Hq, c, D). Grouped heads by broadcasting (no repeated k/v):
    query head h uses kv head h // (Hq / Hkv), as transformers' repeat_kv."""
    n, Hq, c, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    qg = q.reshape(n, Hkv, Hq // Hkv, c, D)
    s = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)).reshape(n, Hq, c, L) * scale  # (n, Hq, c, L)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if allowed.dtype == torch.bool:
        s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)  # finite: a fully masked (padding) row stays finite
    else:
        s = s + allowed
    soft = torch.promote_types(s.dtype, torch.float32)  # the softmax in fp32 at least (fp64 stays fp64: gradcheck)
    if sinks is not None:  # one more logit per head in the normaliser, its column dropped after the softmax
        sink = sinks.to(s.dtype).reshape(1, Hq, 1, 1).expand(n, Hq, c, 1)
        p = torch.softmax(torch.cat([s, sink], -1), -1, dtype=soft)[..., :L]
    else:
        p = torch.softmax(s, -1, dtype=soft)
    p = p.to(v.dtype)
    if dropout > 0:
        p = F.dropout(p, dropout, training=True)
    out = torch.matmul(p.reshape(n, Hkv, Hq // Hkv, c, L), v.unsqueeze(2))  # (n, Hkv, G, c, D)
    return out.reshape(n, Hq, c, D)


def fallback_attention(module, query, key, value, attention_mask, causal: bool, extra: dict, dropout=0.0,
                       scaling=None, window=None, softcap=None, sinks=None):
    """Calls outside the varlen path (generation with a KV cache, left-padded batches; packed rows with
    arguments the varlen path does not reproduce), over transformers' mask (which carries the sliding
    window and, for packed rows, the sample boundaries) -> (B, Tq, Hq, D), None.

    Stock SDPA when nothing else is asked; `explicit_attention` for soft-capping / sinks (SDPA has
    neither); the model's own eager attention (its modeling file's `eager_attention_forward`, the
    reference for its arguments) when the module passes anything else or is bidirectional."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not extra and causal and softcap is None and sinks is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling)
    if not extra and causal:
        compute, out_dtype = attention_dtypes(query.device, query.dtype, key.dtype, value.dtype)
        mask = None if attention_mask is None else attention_mask[:, :, :, : key.shape[2]]
        with torch.autocast(query.device.type, enabled=False):
            out = explicit_attention(query.to(compute), key.to(compute), value.to(compute), scaling, softcap=softcap,
                                     sinks=sinks, window=window, mask=mask, dropout=dropout)
        return out.transpose(1, 2).contiguous().to(out_dtype), None
    home = next((c.__module__ for c in type(module).__mro__ if not c.__module__.startswith("posttrain.")), "")
    eager = getattr(sys.modules.get(home), "eager_attention_forward", None)  # the modeling file (past a Fused* subclass)
    if eager is None:
        raise ValueError(f"{type(module).__name__} passes {sorted(extra)} and its module has no eager_attention_forward "
                         "to fall back to: load the model with varlen_attention=False")
    mask = additive_mask(attention_mask, query, key, window, causal)
    return eager(module, query, key, value, mask, dropout=dropout, scaling=scaling, sliding_window=window,
                 softcap=softcap, **({"s_aux": sinks} if sinks is not None else {}), **extra)


def additive_mask(mask, query, key, window, causal: bool):
    """transformers' SDPA mask (bool, True = attend; or None when it skipped a plain causal one) as the
    additive float mask its eager attention adds to the scores."""
    Lq, Lk = query.shape[2], key.shape[2]
    if mask is None:
        if not causal:
            return None
        mask = band_mask(Lq, Lk, window, query.device, first=Lk - Lq)[None, None]
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(~mask, torch.finfo(query.dtype).min)


_notices: set[str] = set()


def notice(message: str) -> None:
    """A one-line warning, once per distinct message."""
    if message not in _notices:
        _notices.add(message)
        warnings.warn(message, stacklevel=3)


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
