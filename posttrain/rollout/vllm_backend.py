"""vLLM backend (GPU, optional extra `posttrain[vllm]`), behind the engine's API. Imported lazily.

Uses the offline `LLM.generate` API with token-id prompts and `logprobs=0` (the sampled token's
log-prob only). `logprobs_mode="processed_logprobs"` makes vLLM report log-probs of the distribution
after temperature / top-k / top-p, i.e. the behaviour distribution (the default, raw_logprobs, is the
untempered model distribution and would bias importance ratios). Needs vLLM >= 0.10.2.
vLLM does not expose the size of the top-k / top-p set a token was drawn from, so
`Completion.kept_counts` is None: the trainer then falls back to `process_logits` (trainer_logprobs
with kept=None), which re-decides the cut on its own logits and can disagree at the edge.

Checked by benchmarks/check_vllm_gpu.py on a GPU machine (not run in CI: CPU only).
"""

from __future__ import annotations

import time

from posttrain.errors import UserError
from posttrain.rollout.types import Completion, Request, RequestOutput, check_request


def _vllm():
    try:
        import vllm
    except ImportError:
        raise UserError("backend=vllm needs vLLM on a GPU machine: pip install 'posttrain[vllm]'") from None
    return vllm


class VLLMBackend:
    def __init__(self, model_path: str, dtype: str = "bfloat16", seed: int = 0, max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.5, **llm_kwargs):
        vllm = _vllm()
        self.llm = vllm.LLM(model=str(model_path), dtype=dtype, seed=seed, max_model_len=max_model_len,
                            gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=True,
                            logprobs_mode="processed_logprobs", **llm_kwargs)
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
            max_tokens=p.max_new_tokens, stop_token_ids=list(p.stop_token_ids or []), stop=list(p.stop_strings) or None,
            include_stop_str_in_output=True, ignore_eos=p.ignore_eos or p.stop_token_ids == [], seed=p.seed,
            logprobs=0, skip_special_tokens=True)

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
            for (out, _r), res in zip(ok, results):
                for j, c in enumerate(res.outputs):
                    toks = list(c.token_ids)
                    lps = [d[t].logprob for t, d in zip(toks, c.logprobs or [])]
                    out.samples.append(Completion(j, toks, lps, "stop" if c.finish_reason == "stop" else "length", c.text, c.stop_reason))
                out.time_finished = time.perf_counter() - t0
        return outs
