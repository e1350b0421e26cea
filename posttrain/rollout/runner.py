"""Model runner: a compact Llama/Qwen2 forward over a paged KV cache, from the HF module's weights.

It holds references to the HF model's modules. With pack_weights (the default) it computes from a
packed copy of the linear weights that `refresh_weights()` rebuilds (the engine calls it when the
weights change); without, it reads `module.weight` at every forward. The math follows transformers'
modeling_llama / modeling_qwen2: RMSNorm in float32 then cast, RoPE cos/sin from the model's own
`rotary_emb.inv_freq` and `attention_scaling` (so rope_scaling types with static frequencies —
default, linear, llama3, yarn — match), GQA attention with SDPA and scale head_dim**-0.5, SwiGLU MLP.
In fp32 greedy decoding equals HF's token for token (tested). In bf16 it is not bit-identical: other
matmul kernels, the residual add fused into the matmul (one rounding instead of two), and the fused
RMSNorm's sum order move a few values by one bf16 ulp; measured on SmolLM2, the behaviour log-probs
differ from an HF bf16 forward by 0.042 nats on average with or without these fusions.

KV storage: k/v of shape (layers, num_blocks * block_size, kv_heads, head_dim), allocated once;
prefill writes and reads it. Decode attends a contiguous group KV (see `_slot_attend`): per group
slot the shared prompt once and its samples' tokens interleaved. Without it (slot_kv_seqs=0) decode
gathers each sequence's blocks with one `index_select` per layer and masks the padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from posttrain.errors import UserError
from posttrain.models.device import is_cpu
from posttrain.ops import cpu_kernels

SUPPORTED = ("llama", "qwen2")


def check_supported(model) -> None:
    cfg = model.config
    mt = getattr(cfg, "model_type", None)
    if mt not in SUPPORTED:
        raise UserError(f"the builtin engine runs {', '.join(SUPPORTED)} models, not '{mt}'; use backend=hf")
    if hasattr(model, "peft_config"):
        raise UserError("the builtin engine needs plain weights: merge the LoRA adapter (merge_and_unload) or use backend=hf")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise UserError(f"builtin engine: hidden_act '{cfg.hidden_act}' is not supported; use backend=hf")
    if getattr(cfg, "use_sliding_window", False) or "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
        raise UserError("builtin engine: sliding-window attention is not supported; use backend=hf")
    rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope_type in ("dynamic", "longrope"):
        raise UserError(f"builtin engine: rope type '{rope_type}' changes with length; use backend=hf")


def _rmsnorm(x: torch.Tensor, mod) -> torch.Tensor:
    return cpu_kernels.rmsnorm(x, mod.weight, mod.variance_epsilon)  # HF RMSNorm; fused for bf16 CPU tensors, eager elsewhere (CUDA)


class _Linear:
    """x -> concat of `mods`' outputs (e.g. q|k|v, gate|up): one matmul over a packed copy.

    Packed on CPU: the concatenated weight reordered once into oneDNN's blocked layout
    (`mkldnn._reorder_linear_weight`, what torch.compile's CPU freezing uses), so no call re-lays it
    out: at decode shapes (M = 64) bf16/AMX matmuls run 1.3-2.7x faster than `x @ W^T`, fp32 ones up
    to 1.3x. Elsewhere (or if this torch build lacks the op): W^T of the concatenation, contiguous
    (in, out), which MKL runs ~30% faster than F.linear at decode sizes. The copy is rebuilt by
    `refresh()` (the engine calls it when the weights change). Unpacked: reads the modules' weights
    at every call (no extra memory)."""

    def __init__(self, mods, pack: bool, batch_hint: int = 64):
        self.mods, self.pack, self.batch_hint = mods, pack, batch_hint
        self.w = self.b = None  # the packed copy: oneDNN blocked (self.onednn) or W^T
        self.onednn = False

    @torch.no_grad()
    def refresh(self) -> None:
        if not self.pack:
            return
        ws = [m.weight for m in self.mods]
        w = torch.cat(ws) if len(ws) > 1 else ws[0]  # (out, in)
        bs = [getattr(m, "bias", None) for m in self.mods]
        self.b = None if all(b is None for b in bs) else torch.cat(
            [b if b is not None else w.new_zeros(w.shape[0]) for b, w in zip(bs, ws)])
        blocked = _onednn_pack(w, self.batch_hint)
        self.onednn = blocked is not None
        self.w = blocked if self.onednn else w.t().contiguous()

    def __call__(self, x, residual=None):
        """linear(x) (+ residual, fused into the matmul's epilogue where the packed path allows)."""
        if self.onednn:
            if residual is not None:
                return torch.ops.mkldnn._linear_pointwise.binary(x.contiguous(), residual, self.w, self.b, "add")
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.w, self.b, "none", [], "")
        if self.pack:
            out = x @ self.w if self.b is None else torch.addmm(self.b, x, self.w)
        else:
            outs = [F.linear(x, m.weight, getattr(m, "bias", None)) for m in self.mods]
            out = outs[0] if len(outs) == 1 else torch.cat(outs, -1)
        return out if residual is None else out.add_(residual)


def _onednn_pack(w: torch.Tensor, batch_hint: int):
    """`w` (out, in) in oneDNN's blocked layout for about `batch_hint` rows, or None off CPU / without the op.

    Chosen by the weight's own device: oneDNN (mkldnn) ops run CPU tensors only, so CUDA weights take
    the W^T path (cuBLAS) and `_Linear.__call__` never reaches torch.ops.mkldnn for them."""
    if not is_cpu(w) or not torch.backends.mkldnn.is_available() or w.dtype not in (torch.float32, torch.bfloat16):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), batch_hint)
        torch.ops.mkldnn._linear_pointwise(w.new_zeros(1, w.shape[1]), packed, None, "none", [], "")  # usable here?
        return packed
    except (AttributeError, RuntimeError, NotImplementedError):
        return None


class Runner:
    def __init__(self, model, num_blocks: int, block_size: int, max_model_len: int, pack_weights: bool = True,
                 slot_kv_seqs: int = 0):
        check_supported(model)
        cfg = model.config
        self.model = model
        self.layers = model.model.layers
        self.norm, self.embed = model.model.norm, model.model.embed_tokens
        hint = slot_kv_seqs or 64  # decode batch size: the shape that matters

        def lin(mods):
            return _Linear(mods, pack_weights, hint)

        self.qkv = [lin([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj]) for l in self.layers]
        self.o = [lin([l.self_attn.o_proj]) for l in self.layers]
        self.gate_up = [lin([l.mlp.gate_proj, l.mlp.up_proj]) for l in self.layers]
        self.down = [lin([l.mlp.down_proj]) for l in self.layers]
        self.lm_head = lin([model.lm_head])
        self.refresh_weights()
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.group = self.n_heads // self.n_kv
        self.block_size, self.num_blocks = block_size, num_blocks
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        rot = model.model.rotary_emb
        inv_freq = rot.inv_freq.float().to(self.device)
        pos = torch.arange(max_model_len, device=self.device, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * rot.attention_scaling).to(self.dtype)  # (max_len, D), cast as HF does
        self.sin = (emb.sin() * rot.attention_scaling).to(self.dtype)
        half = self.sin.shape[1] // 2
        self.sin_signed = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=1)  # see cpu_kernels.rope_ref
        shape = (len(self.layers), num_blocks * block_size, self.n_kv, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        # group KV (decode attends it without gathering blocks): one contiguous region per group slot of
        # `width` sequences, (layers, group slots, kv, L, D): the group's prompt once at [0, P), then the
        # samples' tokens interleaved: position p >= P of sample m at P + (p - P) * width + m. Width 1 is
        # one region per sequence. L grows (doubling) with the longest group. Off (0 slots): gather blocks.
        self.slot_seqs, self.max_model_len = slot_kv_seqs, max_model_len
        self.k_slot = self.v_slot = None
        self.set_width(1)

    def set_width(self, width: int) -> None:
        """Sequences per group slot (the engine sets it while nothing runs); drops the group KV."""
        self.width = width
        self.k_slot = self.v_slot = None
        self.prompt_len = torch.ones(max(1, self.slot_seqs // width), dtype=torch.long, device=self.device)  # P per group slot

    def _ensure_slot_kv(self, L: int) -> None:
        cap = 0 if self.k_slot is None else self.k_slot.shape[3]
        if L <= cap:
            return
        new_cap = min(self.width * self.max_model_len, max(L, 2 * cap, 64))
        shape = (len(self.layers), self.slot_seqs // self.width, self.n_kv, new_cap, self.head_dim)
        k, v = torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(shape, dtype=self.dtype, device=self.device)
        if cap:
            k[:, :, :, :cap], v[:, :, :, :cap] = self.k_slot, self.v_slot
        self.k_slot, self.v_slot = k, v

    @torch.inference_mode()
    def load_groups(self, groups: list[tuple[int, list[int], int]]) -> None:
        """(group slot, block table, prompt tokens) of groups joining decode: copy the prompt KV from the
        paged cache into the group slot's region, once per group slot."""
        if not self.slot_seqs or not groups:
            return
        self._ensure_slot_kv(max(n for *_, n in groups) + self.width)
        bs = self.block_size
        for gs, table, n in groups:
            idx = torch.tensor([table[j // bs] * bs + j % bs for j in range(n)], device=self.device)
            self.k_slot[:, gs, :, :n] = self.k_cache[:, idx].transpose(1, 2)
            self.v_slot[:, gs, :, :n] = self.v_cache[:, idx].transpose(1, 2)
            self.prompt_len[gs] = n

    @torch.inference_mode()
    def save_decoded(self, slot: int, table: list[int], start: int, end: int) -> None:
        """Copy the KV of positions [start, end) of the sequence in `slot` from its group region to its paged
        blocks. Decode writes only the group KV; the prefix cache needs the blocks of a finished sequence."""
        if not self.slot_seqs or end <= start:
            return
        gs, m = divmod(slot, self.width)
        P = int(self.prompt_len[gs])
        p = torch.arange(start, end, device=self.device)
        off = P + (p - P) * self.width + m
        dst = torch.tensor(table, device=self.device)[p // self.block_size] * self.block_size + p % self.block_size
        self.k_cache[:, dst] = self.k_slot[:, gs, :, off].transpose(1, 2)  # (layers, n, kv, D)
        self.v_cache[:, dst] = self.v_slot[:, gs, :, off].transpose(1, 2)

    def refresh_weights(self) -> None:
        """Rebuild the packed weight copies from the model's current weights."""
        for lin in (*self.qkv, *self.o, *self.gate_up, *self.down, self.lm_head):
            lin.refresh()

    @staticmethod
    def kv_bytes_per_token(model, dtype=None) -> int:
        cfg = model.config
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        el = (dtype or next(model.parameters()).dtype).itemsize
        return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * hd * el

    # ------------------------------------------------------------ KV helpers
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        bs = self.block_size
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for cache in (self.k_cache, self.v_cache):
            view = cache.view(cache.shape[0], self.num_blocks, bs, self.n_kv, self.head_dim)
            view[:, dst] = view[:, src]

    def _gather(self, cache_l: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """cache_l (slots, kv, D), tables (B, nb) -> (B, kv, nb*bs, D)."""
        B, nb = tables.shape
        blocks = cache_l.view(self.num_blocks, self.block_size, self.n_kv, self.head_dim)
        return blocks.index_select(0, tables.reshape(-1)).view(B, nb * self.block_size, self.n_kv, self.head_dim).transpose(1, 2)

    # ------------------------------------------------------------ forward
    def _forward(self, tokens, positions, slots, attend) -> torch.Tensor:
        """tokens/positions (N,) -> final hidden (N, H). `attend(layer, q, k, v)` -> (N, heads*D);
        k/v (N, kv_heads, D) are the new tokens' keys/values, already written to the paged cache at
        `slots` (N,) unless slots is None (decode over the group KV, which writes its own)."""
        N = tokens.shape[0]
        x = F.embedding(tokens, self.embed.weight)
        cos, sin = self.cos[positions], self.sin_signed[positions]  # (N, D)
        nq, nk, D = self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.head_dim
        for i, layer in enumerate(self.layers):
            qkv = self.qkv[i](_rmsnorm(x, layer.input_layernorm))
            qk = cpu_kernels.rope(qkv[:, :nq + nk].view(N, self.n_heads + self.n_kv, D), cos, sin)  # q and k heads at once (eager off CPU)
            q, k, v = qk[:, :self.n_heads], qk[:, self.n_heads:], qkv[:, nq + nk:].view(N, self.n_kv, D)
            if slots is not None:
                self.k_cache[i].index_copy_(0, slots, k)
                self.v_cache[i].index_copy_(0, slots, v)
            x = self.o[i](attend(i, q, k, v), residual=x)  # x + o_proj(attn)
            gu = self.gate_up[i](_rmsnorm(x, layer.post_attention_layernorm))
            I = gu.shape[1] // 2
            x = self.down[i](F.silu(gu[:, :I]) * gu[:, I:], residual=x)  # x + down(silu(gate) * up)
        return _rmsnorm(x, self.norm)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @torch.inference_mode()
    def prefill(self, seqs: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
        """seqs: (all token ids, tokens already cached, block table). Computes KV of the uncached
        tokens of each and returns the logits at each sequence's last position (S, V)."""
        bs, dev = self.block_size, self.device
        toks, pos, slots, spans = [], [], [], []
        for token_ids, cached, table in seqs:
            L = len(token_ids)
            p = range(cached, L)
            toks.extend(token_ids[cached:])
            pos.extend(p)
            slots.extend(table[j // bs] * bs + j % bs for j in p)
            spans.append((len(toks) - (L - cached), L - cached, L, cached, table))
        tokens = torch.tensor(toks, device=dev)
        positions = torch.tensor(pos, device=dev)
        tables = [torch.tensor(t[4], device=dev).unsqueeze(0) for t in spans]
        G, D = self.group, self.head_dim

        def attend(i, q, _k, _v):
            out = []
            for (start, n, L, cached, _), table in zip(spans, tables):
                qi = q[start:start + n].transpose(0, 1)  # (heads, n, D)
                k = self._gather(self.k_cache[i], table)[0, :, :L].repeat_interleave(G, dim=0)  # (heads, L, D)
                v = self._gather(self.v_cache[i], table)[0, :, :L].repeat_interleave(G, dim=0)
                if cached == 0:
                    o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=D ** -0.5)
                else:  # query j (position cached + j) sees keys 0..cached + j
                    mask = torch.arange(L, device=dev)[None, :] <= torch.arange(cached, L, device=dev)[:, None]
                    o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=D ** -0.5)
                out.append(o.transpose(0, 1).reshape(n, -1))
            return torch.cat(out, 0)

        hidden = self._forward(tokens, positions, torch.tensor(slots, device=dev), attend)
        last = torch.tensor([s + n - 1 for s, n, *_ in spans], device=dev)
        return self.logits(hidden[last])

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """One new token per sequence. tokens/positions/rows (engine slots) (B,), block_tables (slots, max
        blocks) block ids of every engine slot -> logits (B, V). With the group KV the new KV goes there
        only (`save_decoded` copies it to the blocks when needed) and the block tables are not read."""
        if self.slot_seqs:
            return self.logits(self._forward(tokens, positions, None, self._slot_attend(positions, rows)))
        bs, B = self.block_size, tokens.shape[0]
        tables = block_tables[rows, :int(positions.max()) // bs + 1]  # (B, nb)
        slots = tables.gather(1, (positions // bs).unsqueeze(1)).squeeze(1) * bs + positions % bs
        T = tables.shape[1] * bs
        mask = (torch.arange(T, device=self.device)[None, :] <= positions[:, None]).view(B, 1, 1, T)
        scale = self.head_dim ** -0.5

        def attend(i, q, _k, _v):
            q = q.view(B, self.n_kv, self.group, self.head_dim)  # the G query heads of a KV head as G rows
            k, v = self._gather(self.k_cache[i], tables), self._gather(self.v_cache[i], tables)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).reshape(B, -1)

        return self.logits(self._forward(tokens, positions, slots, attend))

    def _slot_attend(self, positions, rows):
        """Decode attention over the group KV: one SDPA call, one task per (group slot, KV head).

        Queries of a group slot: its `width` sequences x the G query heads of each KV head, (W*G, D);
        keys: the region's first P + W*(t+1) entries (prompt once + every sample's tokens), with an
        additive mask that lets sample m see the prompt and its own tokens (p - P)*W + m <= its
        position. A group of 8 samples thus reads its prompt once instead of 8 times, in 8x fewer,
        larger tasks (CPU flash attention pays a fixed cost per task). The new k/v are written to the
        region first; queries go into slot order (idle slots in range see finite garbage, then dropped)."""
        W, G, kv, D = self.width, self.group, self.n_kv, self.head_dim
        gs, m = rows // W, rows % W
        P = self.prompt_len[gs]
        off = P + (positions - P) * W + m  # (B,) where each new token goes in its group region
        ngs = int(gs.max()) + 1
        S = ngs * W
        ident = S == rows.shape[0] and bool((rows == torch.arange(S, device=self.device)).all())  # rows are slots 0..S-1
        last = torch.full((S,), -1, dtype=torch.long, device=self.device).index_copy_(0, rows, off)  # idle: -1
        L = int(last.max()) + 1
        self._ensure_slot_kv(L)
        # mask (ngs, 1, W*G, L): key o is visible to slot s iff o < P (prompt) or (o - P) % W == s % W and o <= last[s]
        o = torch.arange(L, device=self.device)
        P_s = self.prompt_len[:ngs].repeat_interleave(W).unsqueeze(1)  # (S, 1)
        own = ((o - P_s) % W == (torch.arange(S, device=self.device) % W).unsqueeze(1)) & (o <= last.unsqueeze(1))
        vis = (o < P_s) | own
        vis[:, 0] = True  # idle slots: something finite
        mask = torch.zeros(S, L, dtype=self.dtype, device=self.device).masked_fill_(~vis, float("-inf"))
        mask = mask.view(ngs, W, 1, L).expand(ngs, W, G, L).reshape(ngs, 1, W * G, L)
        scale = D ** -0.5

        def attend(i, q, k, v):
            self.k_slot[i, gs, :, off] = k
            self.v_slot[i, gs, :, off] = v
            q = q.reshape(-1, kv, G, D)
            qs = q if ident else q.new_zeros(S, kv, G, D).index_copy_(0, rows, q)
            qs = qs.view(ngs, W, kv, G, D).transpose(1, 2).reshape(ngs, kv, W * G, D)
            o_ = F.scaled_dot_product_attention(qs, self.k_slot[i, :ngs, :, :L], self.v_slot[i, :ngs, :, :L], attn_mask=mask, scale=scale)
            o_ = o_.view(ngs, kv, W, G, D).transpose(1, 2).reshape(S, -1)
            return o_ if ident else o_[rows]

        return attend
