"""vLLM backend (GPU, optional extra `posttrain[vllm]`), behind the engine's API. Imported lazily.

Uses the offline `LLM.generate` API with token-id prompts and `logprobs=0` (the sampled token's
log-prob only). `logprobs_mode="processed_logprobs"` makes vLLM report log-probs of the distribution
after temperature / top-k / top-p, i.e. the behaviour distribution (the default, raw_logprobs, is the
untempered model distribution and would bias importance ratios). Needs vLLM >= 0.10.2.
vLLM does not expose the size of the top-k / top-p set a token was drawn from, so
`Completion.kept_counts` is None: the trainer then falls back to `process_logits` (trainer_logprobs
with kept=None), which re-decides the cut on its own logits and can disagree at the edge.

`logprobs_mode="raw_logprobs"` (what `posttrain serve` asks for, as vLLM's own server does) reports the model's
untempered log-probs instead; then `Completion.logprobs` is that distribution too. `SamplingParams.logprobs` /
`prompt_logprobs` map to vLLM's; their top-k lists come from vLLM's ranks. `max_new_tokens=0` (scoring only)
samples one token and drops it, as vLLM's server does for echo without generation.

Checked by benchmarks/check_vllm_gpu.py on a GPU machine (not run in CI: CPU only).
"""

from __future__ import annotations

import time

from posttrain.errors import UserError
from posttrain.rollout.types import Completion, Request, RequestOutput, TokenLogprob, check_request


def _vllm():
    try:
        import vllm
    except ImportError:
        raise UserError("backend=vllm needs vLLM on a GPU machine: pip install 'posttrain[vllm]'") from None
    return vllm


class VLLMBackend:
    def __init__(self, model_path: str, dtype: str = "bfloat16", seed: int = 0, max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.5, logprobs_mode: str = "processed_logprobs", **llm_kwargs):
        vllm = _vllm()
        self.llm = vllm.LLM(model=str(model_path), dtype=dtype, seed=seed, max_model_len=max_model_len,
                            gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=True,
                            logprobs_mode=logprobs_mode, **llm_kwargs)
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.tokenizer = self.llm.get_tokenizer()

    def update_weights(self, state_dict: dict) -> None:
        """Load new weights into the running model in place (names as in the HF model) and drop cached KV."""
        items = [(k, v.detach()) for k, v in state_dict.items()]

        def _load(worker, weights=items):  # runs inside each vLLM worker
            worker.model_runner.model.load_weights(weights=weights)

        self.llm.collective_rpc(_load)
        self.llm.reset_prefix_cache()

    def _params(self, p):
        vllm = _vllm()
        return vllm.SamplingParams(
            n=p.n, temperature=float(p.temperature), top_p=float(p.top_p), top_k=p.top_k if p.top_k > 0 else -1,
            max_tokens=max(1, p.max_new_tokens), stop_token_ids=list(p.stop_token_ids or []), stop=list(p.stop_strings) or None,
            include_stop_str_in_output=True, ignore_eos=p.ignore_eos or p.stop_token_ids == [], seed=p.seed,
            logprobs=p.logprobs or 0, prompt_logprobs=p.prompt_logprobs, skip_special_tokens=True)

    def generate(self, requests: list[Request]) -> list[RequestOutput]:
        from vllm.inputs import TokensPrompt

        t0 = time.perf_counter()
        outs = [RequestOutput(r.request_id if r.request_id is not None else i, list(r.prompt_token_ids or [])) for i, r in enumerate(requests)]
        ok = []
        for out, r in zip(outs, requests):
            try:
                check_request(r, self.max_model_len)
                ok.append((out, r))
            except ValueError as e:
                out.error = f"request {out.request_id}: {e}"
        if ok:
            results = self.llm.generate([TokensPrompt(prompt_token_ids=list(r.prompt_token_ids)) for _, r in ok],
                                        sampling_params=[self._params(r.params) for _, r in ok], use_tqdm=False)
            for (out, r), res in zip(ok, results):
                p = r.params
                if p.prompt_logprobs is not None:
                    out.prompt_logprobs = [None if d is None else _token_logprob(d, t, p.prompt_logprobs)
                                           for t, d in zip(out.prompt_token_ids, res.prompt_logprobs or [])]
                for j, c in enumerate(res.outputs):
                    if p.max_new_tokens == 0:  # scoring only: the one token vLLM had to sample is dropped
                        out.samples.append(Completion(j, [], [], "length", "", model_logprobs=None if p.logprobs is None else []))
                        continue
                    toks = list(c.token_ids)
                    lps = [d[t].logprob for t, d in zip(toks, c.logprobs or [])]
                    mlp = None if p.logprobs is None else [_token_logprob(d, t, p.logprobs) for t, d in zip(toks, c.logprobs or [])]
                    out.samples.append(Completion(j, toks, lps, "stop" if c.finish_reason == "stop" else "length", c.text,
                                                  c.stop_reason, model_logprobs=mlp))
                out.time_finished = time.perf_counter() - t0
        return outs


def _token_logprob(entries: dict, token: int, k: int) -> TokenLogprob:
    """vLLM's {token id: Logprob(logprob, rank, ...)} of one position -> the token's log-prob and the top k by rank."""
    top = sorted(((i, e) for i, e in entries.items() if e.rank is not None and e.rank <= k), key=lambda x: x[1].rank)
    return TokenLogprob(entries[token].logprob, [(i, e.logprob) for i, e in top])
