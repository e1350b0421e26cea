"""Reference backend: transformers `generate`, behind the engine's API (slow; for checking and for models
the built-in runner does not support).

Behaviour log-probs come from `output_scores`, which are the logits after HF's own temperature /
top-k / top-p warpers, i.e. the distribution HF sampled from. HF's top-p breaks ties by sort order
where posttrain.ops.sampling keeps whole tied groups; everything else is the same definition.
Kept counts (`Completion.kept_counts`, truncated requests only) are the number of finite processed
scores per step: the size of the set HF actually sampled from. Reported model log-probs
(`SamplingParams.logprobs`) come from `output_logits` (the raw logits, before the warpers).
One `generate` call per request (num_return_sequences = n) under `torch.manual_seed(seed)`, so a
request's samples do not depend on the other requests (they do depend on HF's RNG use, so they differ
from the built-in engine's draws).
"""

from __future__ import annotations

import random
import time

import torch

from posttrain.rollout.scoring import logits_logprobs, prompt_logprobs
from posttrain.rollout.types import Completion, Request, RequestOutput, check_request, default_stop_ids

# Logits processors a model's generation_config.json may switch on (repetition penalty, min-p, ...) set to their
# neutral values: the sampled distribution must be temperature / top-k / top-p only, the one the trainer recomputes.
NEUTRAL = dict(repetition_penalty=1.0, no_repeat_ngram_size=0, min_p=0.0, typical_p=1.0, epsilon_cutoff=0.0,
               eta_cutoff=0.0, min_length=0, encoder_repetition_penalty=1.0, encoder_no_repeat_ngram_size=0)


class HFBackend:
    """`generate(requests)` through transformers; it samples the model it was given (a PEFT model: with its
    adapter), in eval mode (dropout off), and restores the training mode after."""

    name = "hf"

    def __init__(self, model, tokenizer=None, seed: int = 0, max_model_len: int | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.rng = random.Random(seed)
        limit = getattr(model.config, "max_position_embeddings", None) or 2048
        self.max_model_len = min(max_model_len or limit, limit)
        self.default_eos = default_stop_ids(model, tokenizer)
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        self.generated_tokens, self.seconds = 0, 0.0

    def sync_weights(self) -> None:
        """Nothing to do: every call reads the model's current weights."""

    def update_weights(self, state_dict: dict) -> None:
        self.model.load_state_dict(state_dict, strict=False)

    def metrics(self) -> dict:
        return {"generated_tokens": self.generated_tokens, "decode_s": self.seconds,
                "tokens_per_s": self.generated_tokens / self.seconds if self.seconds else 0.0}

    def generate(self, requests: list[Request]) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outs = []
        was_training = self.model.training
        self.model.eval()
        try:
            for i, r in enumerate(requests):
                out = RequestOutput(r.request_id if r.request_id is not None else i, list(r.prompt_token_ids or []))
                seed = r.params.seed if r.params.seed is not None else self.rng.getrandbits(63)
                try:
                    check_request(r, self.max_model_len, self.vocab_size, has_tokenizer=self.tokenizer is not None)
                    if r.params.prompt_logprobs is not None:
                        out.prompt_logprobs = prompt_logprobs(self.model, r.prompt_token_ids, r.params.prompt_logprobs)
                    out.samples = self._one(r, seed)
                except ValueError as e:
                    out.error = f"request {out.request_id}: {e}"
                out.time_finished = time.perf_counter() - t0
                outs.append(out)
        finally:
            self.model.train(was_training)
        self.seconds += time.perf_counter() - t0
        self.generated_tokens += sum(len(s.token_ids) for o in outs for s in o.samples)
        return outs

    def _pad_id(self) -> int:
        pad = getattr(self.model.generation_config, "pad_token_id", None)
        if pad is None and self.tokenizer is not None:
            pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.default_eos[0] if self.default_eos else 0
        return pad

    @torch.inference_mode()
    def _one(self, r: Request, seed: int) -> list[Completion]:
        p = r.params
        if p.max_new_tokens == 0:  # scoring only
            empty = "" if self.tokenizer is not None else None
            return [Completion(j, [], [], "length", empty, model_logprobs=None if p.logprobs is None else []) for j in range(p.n)]
        stop_ids = [] if p.ignore_eos else (self.default_eos if p.stop_token_ids is None else list(p.stop_token_ids))
        max_new = min(p.max_new_tokens, self.max_model_len - len(r.prompt_token_ids))
        kw = dict(max_new_tokens=max_new, num_return_sequences=p.n, output_scores=True, return_dict_in_generate=True,
                  output_logits=p.logprobs is not None, pad_token_id=self._pad_id(), **NEUTRAL)
        if p.temperature == 0:
            kw.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        else:
            kw.update(do_sample=True, temperature=float(p.temperature), top_k=p.top_k, top_p=float(p.top_p))
        if stop_ids:
            kw["eos_token_id"] = stop_ids
        else:
            kw["min_new_tokens"] = max_new  # no stop token: suppress the model's eos
        if p.stop_strings:
            kw.update(stop_strings=list(p.stop_strings), tokenizer=self.tokenizer)
        device = next(self.model.parameters()).device
        ids = torch.tensor([r.prompt_token_ids], device=device)
        rng_state = torch.random.get_rng_state()
        torch.manual_seed(seed & (2**63 - 1))
        try:
            res = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
        finally:
            torch.random.set_rng_state(rng_state)
        new = res.sequences[:, ids.shape[1]:]  # (n, T)
        kept = None
        if p.temperature == 0:  # one-hot distribution: log-prob 0 (posttrain.ops.sampling convention)
            lp = torch.zeros(new.shape, dtype=torch.float32, device=new.device)
        else:
            scores = torch.stack(res.scores, 1).float()  # (n, T, V) processed logits
            lp = torch.log_softmax(scores, -1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
            if p.truncates(scores.shape[-1]):
                kept = torch.isfinite(scores).sum(-1)  # (n, T) size of the set each token was drawn from
        samples = []
        for j in range(p.n):
            toks, lps = new[j].tolist(), lp[j].tolist()
            reason, stop = "length", None
            for t, tok in enumerate(toks):
                if tok in stop_ids:
                    toks, lps, reason, stop = toks[:t + 1], lps[:t + 1], "stop", tok
                    break
            if reason == "length" and p.stop_strings:  # HF pads after a stop string: cut at the first hit
                for t in range(len(toks)):
                    text = self.tokenizer.decode(toks[max(0, t - 64):t + 1])
                    hit = [s for s in p.stop_strings if s in text]
                    if hit:
                        toks, lps, reason, stop = toks[:t + 1], lps[:t + 1], "stop", hit[0]
                        break
            text = self.tokenizer.decode(toks, skip_special_tokens=True) if self.tokenizer is not None else None
            kc = None if kept is None else kept[j, :len(toks)].tolist()
            mlp = None
            if p.logprobs is not None:  # the raw logits (before HF's warpers): the model's own distribution
                raw = torch.stack([step[j] for step in res.logits[:len(toks)]]) if toks else torch.zeros(0, 1)
                mlp = logits_logprobs(raw, torch.tensor(toks, dtype=torch.long), p.logprobs) if toks else []
            samples.append(Completion(j, toks, lps, reason, text, stop, kc, mlp))
        return samples
