"""The built-in rollout engine: requests in, samples with behaviour log-probs out.

    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=64))
    outs = engine.generate([Request(prompt_ids, SamplingParams(n=8, temperature=1.0, max_new_tokens=64))])

Parts (like nano-vllm): `sequence` (state of one sample), `kv` (paged blocks, prefix cache),
`scheduler` (admission, growth, preemption; model-free), `runner` + `arch` (one decoder forward over the
KV cache for the families in runner.SUPPORTED), and this file: per-slot tensors and `step()`, which reads top to bottom:
schedule -> forward -> sample -> record/finish.

Per-sequence sampling state lives in tensors indexed by slot (temperature, top-k/p, seed, stop ids,
generated tokens and log-probs), so a decode step does no Python work per sequence: Python touches a
sequence only when it joins, needs a new KV block (once per block_size tokens), has stop strings, or
finishes.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import Field

from posttrain.config import Config
from posttrain.errors import UserError
from posttrain.models.device import is_cpu
from posttrain.ops import cpu_kernels
from posttrain.ops.host_memory import keep_freed_memory
from posttrain.ops.sampling import counter_uniforms, sample_logits
from posttrain.rollout.kv import BlockManager
from posttrain.rollout.runner import Runner
from posttrain.rollout.scheduler import Batch, Scheduler
from posttrain.rollout.scoring import logits_logprobs, prompt_logprobs
from posttrain.rollout.sequence import Group, Sequence, Status
from posttrain.rollout.types import Completion, Request, RequestOutput, SamplingParams, check_request, default_stop_ids


class EngineConfig(Config):
    """Built-in engine settings."""

    max_num_seqs: int = Field(64, ge=1, description="sequences decoded together (batch rows)")
    max_model_len: int = Field(2048, ge=2, description="prompt + completion tokens per sequence (capped at the model's max_position_embeddings)")
    block_size: int = Field(16, ge=1, description="tokens per KV block")
    kv_cache_mb: float = Field(1024, gt=0, description="KV cache size in MiB, allocated once (also capped at 2 x max_num_seqs x max_model_len tokens)")
    max_prefill_tokens: int = Field(4096, ge=1, description="uncached prompt tokens per prefill step (one longer prompt still runs alone)")
    seed: int = Field(0, description="seed for requests that give none (drawn in request order)")
    slot_kv: bool = Field(True, description="decode keeps the running sequences' KV in contiguous per-group regions (filled from the paged blocks when a group joins, copied back when a sequence finishes; no per-layer gather of blocks; + about max_num_seqs x longest running context of KV memory); false gathers the paged blocks")
    group_kv: bool = Field(True, description="when every request of a generate() call has the same n and all its samples run at once, keep each group's prompt KV once and attend per group (fewer, larger attention tasks); slots are then handed out per group")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="compute dtype of the engine: auto = the model's weights' dtype; bfloat16 over float32 weights samples from a bf16 cast of them (packed copies, KV cache and activations in bf16: the numbers of the model loaded in bf16), rebuilt at every weight sync")
    pack_weights: bool = Field(True, description="run from a fused (q|k|v, gate|up), transposed copy of the linear weights (one more copy of them in memory), rebuilt when the weights change; false reads the model's weights at every forward")


@dataclass
class EngineStats:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_tokens: int = 0  # prompt tokens computed
    cached_tokens: int = 0  # prompt tokens served by the prefix cache or shared by forking
    generated_tokens: int = 0
    decode_steps: int = 0
    occupancy_sum: float = 0.0  # running / max_num_seqs, summed over decode steps
    peak_kv_blocks: int = 0
    window_peak_kv_blocks: int = 0  # since the last reset_window (a step's peak)
    preemptions: int = 0

    def as_dict(self, kv_block_bytes: int = 0, max_num_seqs: int = 1) -> dict:
        total = self.prefill_s + self.decode_s
        return {
            "generated_tokens": self.generated_tokens, "prefill_tokens": self.prefill_tokens,
            "cached_prompt_tokens": self.cached_tokens, "prefill_s": self.prefill_s, "decode_s": self.decode_s,
            "tokens_per_s": self.generated_tokens / total if total else 0.0,
            "decode_tokens_per_s": self.generated_tokens / self.decode_s if self.decode_s else 0.0,
            "decode_steps": self.decode_steps,
            "batch_occupancy": self.occupancy_sum / self.decode_steps if self.decode_steps else 0.0,
            "peak_kv_mb": self.peak_kv_blocks * kv_block_bytes / 2**20, "preemptions": self.preemptions,
        }


@dataclass(eq=False)
class _RequestState:
    request: Request
    output: RequestOutput
    seed: int
    stop_ids: list[int]
    remaining: int
    completions: dict = field(default_factory=dict)


class Engine:
    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None):
        self.model, self.tokenizer, self.config = model, tokenizer, config or EngineConfig()
        cfg = self.config
        mcfg = model.config
        self.max_model_len = min(cfg.max_model_len, getattr(mcfg, "max_position_embeddings", cfg.max_model_len))
        bs = cfg.block_size
        per_seq_blocks = -(-self.max_model_len // bs)
        dtype = None if cfg.dtype == "auto" else getattr(torch, cfg.dtype)
        self.kv_block_bytes = Runner.kv_bytes_per_token(model, dtype) * bs
        num_blocks = min(int(cfg.kv_cache_mb * 2**20 // self.kv_block_bytes), 2 * cfg.max_num_seqs * per_seq_blocks)
        if num_blocks < per_seq_blocks:
            need_mb = per_seq_blocks * self.kv_block_bytes / 2**20
            raise UserError(f"engine.kv_cache_mb={cfg.kv_cache_mb:g} holds {num_blocks * bs} tokens of this model's KV "
                            f"cache, less than one sequence of max_model_len={self.max_model_len}: give "
                            f"engine.kv_cache_mb >= {need_mb:.3g} (or a smaller engine.max_model_len)")
        self.runner = Runner(model, num_blocks, bs, self.max_model_len, cfg.pack_weights,
                             cfg.max_num_seqs if cfg.slot_kv else 0, dtype)
        if is_cpu(self.runner.device):  # host malloc tuning; CUDA tensors use PyTorch's caching allocator instead
            keep_freed_memory()  # per-step tensors reuse heap pages instead of faulting in fresh ones (see host_memory)
        self.blocks = BlockManager(num_blocks, bs)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_prefill_tokens)
        self.default_eos = default_stop_ids(self.model, self.tokenizer)
        self.rng = random.Random(cfg.seed)
        self.stats = EngineStats()
        self._params = list(self.model.parameters())  # walked once (1.5 ms per walk of a 135M model), again at each sync
        self._weights_version = self._version()
        self._t0 = time.perf_counter()
        S, dev = cfg.max_num_seqs, self.runner.device
        z = lambda dt=torch.long: torch.zeros(S, dtype=dt, device=dev)
        self.tables = torch.zeros(S, per_seq_blocks, dtype=torch.long, device=dev)
        self.ntok, self.last, self.ngen, self.max_new = z(), z(), z(), z()
        self.seed, self.sidx, self.topk = z(), z(), z()
        self.temp, self.topp = z(torch.float32), z(torch.float32)
        self.stop_ids = torch.full((S, 1), -1, dtype=torch.long, device=dev)
        self.has_stop_str = z(torch.bool)
        self.out_tok = torch.zeros(S, self.max_model_len, dtype=torch.long, device=dev)
        self.out_lp = torch.zeros(S, self.max_model_len, dtype=torch.float32, device=dev)
        self.out_kept = torch.zeros(S, self.max_model_len, dtype=torch.int32, device=dev)  # kept-set sizes
        self._slot_seq: dict[int, Sequence] = {}
        self._rows = None  # cached LongTensor of running slots
        self._rows_temp = (None, None)  # (rows, temp[rows]) of the last plain draw: the running set's, until it changes
        self._reporting = 0  # requests in flight that asked for their tokens' model log-probs (SamplingParams.logprobs)
        self._unplain = 0  # requests in flight that may draw from anything but the whole softmax (greedy, top-k, top-p)

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold: [0, vocab_size) (the embedding rows)."""
        return self.runner.embed.weight.shape[0]

    # ------------------------------------------------------------ weights
    def _version(self):
        return tuple((p.data_ptr(), p._version) for p in self._params)

    def reset_prefix_cache(self) -> None:
        """Forget the cached prompt KV. Weights unchanged only: after writes via `.data` or a fused
        optimizer step call `sync_weights()`, which also rebuilds the packed weights."""
        self.blocks.reset_prefix_cache()

    def sync_weights(self) -> None:
        """The trainer changed the shared weights (call after every optimizer step, or after writes via `.data`):
        rebuild the packed weight copies and forget the cached KV.

        Changes are also detected through tensor version counters, but fused optimizers
        (AdamW(fused=True)) and `.data` writes update parameters without bumping them, and parameters replaced
        by new tensors (load_state_dict(assign=True)) are not seen, so trainers must call this.
        """
        self.reset_prefix_cache()
        self.runner.refresh_weights()
        self._params = list(self.model.parameters())
        self._weights_version = self._version()

    def _check_weights(self) -> None:
        if self._version() != self._weights_version:  # weights changed in place: packed copy and cached KV are stale
            self.sync_weights()

    @torch.no_grad()
    def update_weights(self, state_dict: dict) -> None:
        """Copy new weights into the engine's model in place (names as in model.state_dict())."""
        params = self.model.state_dict(keep_vars=True)  # includes tied names (lm_head.weight)
        for name, value in state_dict.items():
            if name not in params:
                raise KeyError(f"update_weights: unknown parameter '{name}'")
            params[name].copy_(value)
        self.sync_weights()

    # ------------------------------------------------------------ requests
    def add_request(self, request: Request, index: int = 0) -> _RequestState:
        """Validate and queue one request; a bad one gets `output.error` and is not queued.
        On an idle engine this also returns to per-sequence slots (width 1): unlike `generate`, it
        cannot know whether more requests will follow."""
        if not self.scheduler.has_work():
            self._set_width(1)
        return self._add(request, index)

    def _add(self, request: Request, index: int) -> _RequestState:
        p = request.params
        out = RequestOutput(request.request_id if request.request_id is not None else index, list(request.prompt_token_ids or []))
        seed = p.seed if p.seed is not None else self.rng.getrandbits(63)
        state = _RequestState(request, out, seed, [] if p.ignore_eos else (self.default_eos if p.stop_token_ids is None else list(p.stop_token_ids)), p.n)
        try:
            check_request(request, self.max_model_len, self.runner.embed.weight.shape[0], self.tokenizer is not None)
        except ValueError as e:
            out.error = f"request {out.request_id}: {e}"
            state.remaining = 0
            return state
        if p.prompt_logprobs is not None:  # one forward of the whole prompt through the model's own layers
            out.prompt_logprobs = prompt_logprobs(self.model, request.prompt_token_ids, p.prompt_logprobs)
        if p.max_new_tokens == 0:  # scoring only: n empty samples, nothing scheduled
            out.samples = [Completion(j, [], [], "length", "" if self.tokenizer is not None else None,
                                      model_logprobs=None if p.logprobs is None else []) for j in range(p.n)]
            out.time_first_token = out.time_finished = time.perf_counter() - self._t0
            state.remaining = 0
            return state
        self._in_flight(p, +1)
        W = self.scheduler.width
        chunk, ids = self.config.max_num_seqs // W * W, request.prompt_token_ids
        for j0 in range(0, p.n, chunk):
            parent = Sequence(list(ids), len(ids), j0, state)
            self.scheduler.add(Group(parent, list(range(j0, min(p.n, j0 + chunk)))))
        return state

    def generate(self, requests: list[Request], on_output=None) -> list[RequestOutput]:
        """Run requests to completion (continuous batching); outputs in request order.
        `on_output(output)`, if given, is called with each request's output as soon as its last sample
        finishes (refused requests first), so a verifier can score while the engine keeps decoding."""
        self._t0 = time.perf_counter()
        states = self.submit(requests)
        pending = states
        # Weights are checked for in-place changes once here and after callbacks, not before every step: nothing
        # else runs between this loop's steps, and the check touches every parameter (~0.35 ms of a decode step).
        self._check_weights()
        while pending and on_output is not None:  # report what is done, then step (O(pending) per step)
            done = [s for s in pending if s.remaining == 0]
            if done:
                pending = [s for s in pending if s.remaining != 0]
                for s in done:
                    on_output(s.output)
                self._check_weights()
            if pending and not self.scheduler.has_work():
                break  # defensive: a request with samples left always has queued work
            if pending:
                self._step()
        while self.scheduler.has_work():
            self._step()
        return [s.output for s in states]

    def submit(self, requests: list[Request]) -> list[_RequestState]:
        """Queue requests without running them: the caller drives `step()` while `has_work()` and reads
        each state's `output` once its `remaining` is 0 (a streaming producer, e.g. asynchronous RL, adds
        the next batch while the last one's long samples still decode). On an idle engine the slot width
        is chosen for this batch, as in `generate`."""
        if not self.scheduler.has_work():
            self._set_width(self._group_width(requests))
        return [self._add(r, i) for i, r in enumerate(requests)]

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def snapshot(self, state: _RequestState) -> list[Completion | None]:
        """What each sample of a request submitted with `add_request` / `submit` has generated so far, for a
        caller that streams: finished samples give their Completion, running ones a Completion with the
        tokens so far (finish_reason None; model_logprobs when asked), waiting ones None. A sample's tokens
        only grow (a preempted sample resumes where it was). Reads each running sample's tokens from the
        device: for a few streamed requests per step, not for every sequence."""
        out: list[Completion | None] = [state.completions.get(j) for j in range(state.request.params.n)]
        if state.remaining == 0:
            return list(state.output.samples) if state.output.samples else out
        want = state.request.params.logprobs is not None
        for s in self.scheduler.running:
            if s.request is state and out[s.sample_index] is None and s.status is Status.RUNNING:
                n = int(self.ngen[s.slot])
                out[s.sample_index] = Completion(s.sample_index, self.out_tok[s.slot, :n].tolist(), [], None,
                                                 model_logprobs=list(s.model_logprobs) if want else None)
        return out

    def _group_width(self, requests: list[Request]) -> int:
        """Sequences per group slot for this batch of requests: n when all requests sample the same
        n > 1 and every sample gets a slot at once (then slots handed out per group cost nothing: no
        sequence waits for one), else 1 (per-sequence slots, refilled as each sequence finishes).
        One exception: a sequence preempted for KV blocks comes back as a group of one and needs a
        whole free group slot, so under KV pressure it may wait for a group to finish."""
        cfg = self.config
        ns = {r.params.n for r in requests}
        if not (cfg.group_kv and cfg.slot_kv) or len(ns) != 1:
            return 1
        n = ns.pop()
        return n if 1 < n and n * len(requests) <= cfg.max_num_seqs else 1

    def _set_width(self, width: int) -> None:
        if width != self.scheduler.width:
            self.scheduler.set_width(width)
            self.runner.set_width(width)

    # ------------------------------------------------------------ the step
    def step(self) -> None:
        """One scheduling step (a prefill or a decode of the running batch), after checking the weights for
        in-place changes (a caller driving `step()` may have trained in between)."""
        self._check_weights()
        self._step()

    def _step(self) -> None:
        batch = self.scheduler.schedule()
        for g in batch.rejected:
            self._fail(g, f"prompt of {len(g.parent.token_ids)} tokens does not fit in the KV cache ({self.blocks.num_blocks} blocks)")
        if batch.kind == "prefill" and batch.groups:
            self._prefill(batch)
        elif batch.kind == "decode":
            self._decode(batch)
        self.stats.peak_kv_blocks = max(self.stats.peak_kv_blocks, self.blocks.num_used)
        self.stats.window_peak_kv_blocks = max(self.stats.window_peak_kv_blocks, self.blocks.num_used)

    def _prefill(self, batch: Batch) -> None:
        t = time.perf_counter()
        groups = batch.groups
        for g in groups:
            self.stats.prefill_tokens += len(g.parent.token_ids) - g.parent.num_computed
            self.stats.cached_tokens += g.parent.num_computed + (g.size - 1) * len(g.parent.token_ids)
            if not g.resume:
                g.parent.request.output.num_cached_prompt_tokens = g.parent.num_computed
        logits = self.runner.prefill([(g.parent.token_ids, g.parent.num_computed, g.parent.block_table) for g in groups])
        seqs, which = [], []
        for gi, g in enumerate(groups):
            started, copies, gslots = self.scheduler.start(g)
            self.runner.copy_blocks(copies)
            self.runner.plan_slot_kv(len(g.parent.token_ids) + self.runner.width * self._tokens_left(g.parent))
            self.runner.load_groups([(gs, g.parent.block_table, len(g.parent.token_ids)) for gs in gslots])
            for s in started:
                self._join(s)
            seqs += started
            which += [gi] * len(started)
            st = g.parent.request
            if st.output.time_first_token is None:
                st.output.time_first_token = time.perf_counter() - self._t0
        self._rows = None
        self._sample_and_record(seqs, torch.tensor([s.slot for s in seqs], device=self.runner.device),
                                logits[torch.tensor(which, device=logits.device)])
        self.stats.prefill_s += time.perf_counter() - t

    def _decode(self, batch: Batch) -> None:
        t = time.perf_counter()
        for s in batch.preempted:
            self._leave(s)
            self.stats.preemptions += 1
        for s, j, b in batch.new_blocks:
            self.tables[s.slot, j] = b
        rows = self._running_rows()
        if rows.numel():
            pos = self.ntok[rows] - 1
            logits = self.runner.decode(self.last[rows], pos, self.tables, rows)
            self._sample_and_record(self.scheduler.running, rows, logits)
            self.stats.decode_steps += 1
            self.stats.occupancy_sum += rows.numel() / self.config.max_num_seqs
        self.stats.decode_s += time.perf_counter() - t

    def _sample_and_record(self, seqs: list[Sequence], rows: torch.Tensor, logits: torch.Tensor) -> None:
        """Sample one token per row, store it with its behaviour log-prob, finish what stops."""
        if self.runner.step_kernels:  # CPU: the bookkeeping in two C++ calls instead of ~30 small tensor ops
            tok, lp, kept = self._draw(rows, logits, cpu_kernels.row_uniforms(self.seed, self.sidx, self.ngen, rows))
            hits = cpu_kernels.record_tokens(rows, tok, lp, kept, self.ngen, self.ntok, self.last, self.out_tok,
                                             self.out_lp, self.out_kept, self.stop_ids, self.max_new, self.has_stop_str)
        else:
            g = self.ngen[rows]
            tok, lp, kept = self._draw(rows, logits, counter_uniforms(self.seed[rows], self.sidx[rows], g))
            hits = self._record(rows, g, tok, lp, kept)
        self.stats.generated_tokens += rows.numel()
        if self._reporting:  # requests that asked for their tokens' model log-probs (Python work for those rows only)
            self._record_model_logprobs(seqs, logits, tok)
        finished = [(seqs[i], *self._stop_reason(seqs[i])) for i in hits]
        for seq, stop, reason in finished:
            if stop is not None or reason == "length":
                self._finish(seq, reason, stop)

    def _draw(self, rows: torch.Tensor, logits: torch.Tensor, uniforms: torch.Tensor):
        """(tokens, behaviour log-probs, kept counts) of the rows' draws with their slots' sampling parameters."""
        if self._unplain:
            return sample_logits(logits, self.temp[rows], self.topk[rows], self.topp[rows], uniforms, with_kept=True)
        # every request in flight draws from the whole softmax: only the temperatures matter, gathered once per
        # running set (a small op costs tens of microseconds in a decode step)
        if self._rows_temp[0] is not rows:
            self._rows_temp = (rows, self.temp[rows])
        t = self._rows_temp[1]
        return sample_logits(logits, t, None, None, uniforms, with_kept=True, all_plain=True)

    def _record(self, rows: torch.Tensor, g: torch.Tensor, tok: torch.Tensor, lp: torch.Tensor, kept: torch.Tensor) -> list[int]:
        """`cpu_kernels.record_tokens` in tensor ops (any device): store row i's draw at its slot rows[i]'s completion
        index g[i], advance the slot's counters; -> the rows that stopped or have stop strings to check."""
        self.out_tok[rows, g] = tok
        self.out_lp[rows, g] = lp
        self.out_kept[rows, g] = kept.int()
        self.ngen[rows] = g + 1
        self.ntok[rows] += 1
        self.last[rows] = tok
        done = (self.stop_ids[rows] == tok.unsqueeze(1)).any(1) | (g + 1 >= self.max_new[rows])
        # stop strings need the text: those rows (only) are checked in Python every step
        return (done | self.has_stop_str[rows]).nonzero().squeeze(1).tolist()

    def _record_model_logprobs(self, seqs: list[Sequence], logits: torch.Tensor, tok: torch.Tensor) -> None:
        """Append to each reporting sequence its new token's log-prob under the model (log_softmax of the raw
        logits: temperature 1, no top-k / top-p) and the top-k alternatives it asked for."""
        picked = [(i, s.request.request.params.logprobs) for i, s in enumerate(seqs) if s.request.request.params.logprobs is not None]
        if not picked:
            return
        idx = torch.tensor([i for i, _ in picked], device=logits.device)
        top = max(k for _, k in picked)
        for (i, k), lp in zip(picked, logits_logprobs(logits[idx], tok[idx], top)):
            lp.top = lp.top[:k]
            seqs[i].model_logprobs.append(lp)

    # ------------------------------------------------------------ sequence transitions
    def _max_new(self, s: Sequence) -> int:
        """Completion tokens sequence `s` may have at most: its request's max_new_tokens within max_model_len."""
        return min(s.request.request.params.max_new_tokens, self.max_model_len - s.prompt_len)

    def _tokens_left(self, s: Sequence) -> int:
        """Tokens sequence `s` may still generate."""
        return max(0, self._max_new(s) - s.num_generated)

    def _join(self, s: Sequence) -> None:
        st: _RequestState = s.request
        p, k = st.request.params, s.slot
        n = len(s.token_ids)
        dev = self.tables.device  # host lists -> the engine's device explicitly (no implicit CPU tensors)
        self.tables[k, :len(s.block_table)] = torch.tensor(s.block_table, device=dev)
        self.ntok[k], self.last[k], self.ngen[k] = n, s.token_ids[-1], s.num_generated
        self.max_new[k] = self._max_new(s)
        self.temp[k], self.topk[k], self.topp[k] = float(p.temperature), p.top_k, float(p.top_p)
        self.seed[k], self.sidx[k] = st.seed, s.sample_index
        if len(st.stop_ids) > self.stop_ids.shape[1]:
            pad = torch.full((self.stop_ids.shape[0], len(st.stop_ids) - self.stop_ids.shape[1]), -1, dtype=torch.long, device=self.stop_ids.device)
            self.stop_ids = torch.cat([self.stop_ids, pad], 1)
        self.stop_ids[k] = -1
        if st.stop_ids:
            self.stop_ids[k, :len(st.stop_ids)] = torch.tensor(st.stop_ids, device=dev)
        if s.num_generated:  # resumed after preemption: restore its completion so far
            self.out_tok[k, :s.num_generated] = torch.tensor(s.token_ids[s.prompt_len:], device=dev)
            self.out_lp[k, :s.num_generated] = torch.tensor(s.logprobs, dtype=torch.float32, device=dev)
            self.out_kept[k, :s.num_generated] = torch.tensor(s.kept_counts, dtype=torch.int32, device=dev)
        self.has_stop_str[k] = bool(p.stop_strings)
        self._slot_seq[k] = s

    def _sync(self, s: Sequence) -> None:
        n = int(self.ngen[s.slot])
        s.token_ids = s.token_ids[:s.prompt_len] + self.out_tok[s.slot, :n].tolist()
        s.logprobs = self.out_lp[s.slot, :n].tolist()
        s.kept_counts = self.out_kept[s.slot, :n].tolist()

    def _leave(self, s: Sequence) -> None:
        """A preempted sequence: keep its tokens; its slot may be reused."""
        self._sync(s)
        self._rows = None

    def _stop_reason(self, s: Sequence):
        st: _RequestState = s.request
        k = s.slot
        n = int(self.ngen[k])
        tok = int(self.out_tok[k, n - 1])
        if tok in st.stop_ids:
            return tok, "stop"
        if st.request.params.stop_strings:
            window = max(len(x) for x in st.request.params.stop_strings) + 8
            tail = self.tokenizer.decode(self.out_tok[k, max(0, n - window):n].tolist())
            for x in st.request.params.stop_strings:
                if x in tail:
                    return x, "stop"
        if n >= int(self.max_new[k]):
            return None, "length"
        return None, None

    def _finish(self, s: Sequence, reason: str, stop) -> None:
        self._sync(s)
        self.scheduler.finish(s)
        self._rows = None
        st: _RequestState = s.request
        completion = s.token_ids[s.prompt_len:]
        text = self.tokenizer.decode(completion, skip_special_tokens=True) if self.tokenizer is not None else None
        kept = s.kept_counts if st.request.params.truncates(self.runner.embed.weight.shape[0]) else None
        mlp = None if st.request.params.logprobs is None else s.model_logprobs[:len(completion)]
        st.completions[s.sample_index] = Completion(s.sample_index, completion, s.logprobs, reason, text, stop, kept, mlp)
        st.remaining -= 1
        if st.remaining == 0:
            self._in_flight(st.request.params, -1)
            st.output.samples = [st.completions[j] for j in range(st.request.params.n)]
            st.output.time_finished = time.perf_counter() - self._t0

    def _fail(self, g: Group, message: str) -> None:
        st: _RequestState = g.parent.request
        st.output.error = f"request {st.output.request_id}: {message}"
        st.output.samples = []
        if st.remaining:
            self._in_flight(st.request.params, -1)
        st.remaining = 0
        # drop the request's other queued groups
        self.scheduler.waiting = type(self.scheduler.waiting)(x for x in self.scheduler.waiting if x.parent.request is not st)

    def _in_flight(self, p: SamplingParams, sign: int) -> None:
        """Count a request in (+1) or out (-1) of the counters that let a step skip per-row work."""
        self._reporting += sign * (p.logprobs is not None)
        self._unplain += sign * (p.temperature == 0 or p.top_k > 0 or p.top_p < 1)

    def _running_rows(self) -> torch.Tensor:
        if self._rows is None:
            self._rows = torch.tensor([s.slot for s in self.scheduler.running], dtype=torch.long, device=self.runner.device)
        return self._rows

    def memory_bytes(self) -> int:
        """Bytes this engine holds beside the model's own weights (KV cache, packed weights), for the planner."""
        return self.runner.memory_bytes()

    def metrics(self) -> dict:
        d = self.stats.as_dict(self.kv_block_bytes, self.config.max_num_seqs)
        d["kv_in_use_mb"] = self.blocks.num_used * self.kv_block_bytes / 2**20
        d["kv_capacity_mb"] = self.blocks.num_blocks * self.kv_block_bytes / 2**20
        d["window_peak_kv_mb"] = self.stats.window_peak_kv_blocks * self.kv_block_bytes / 2**20
        return d

    def reset_window(self) -> None:
        """Start a new window for `window_peak_kv_mb` (rollout.signals.EngineWindow: one per step)."""
        self.stats.window_peak_kv_blocks = self.blocks.num_used
