"""`posttrain serve model=… port=…`: a small OpenAI-compatible server over the built-in engine, so a local
model can judge (`reward=judge`, `posttrain label`) or be judged by anything that speaks the OpenAI API.

    GET  /v1/models            the one served model
    POST /v1/chat/completions  messages -> chat template (with the generation prompt) -> n samples
    POST /v1/completions       prompt (a string or a list of strings; no chat template) -> n samples each
    GET  /health

Request keys: model, n, temperature, top_p, max_tokens, seed, stop (a string or up to 4); others that
OpenAI defines and this server does not implement (stream, logprobs, tools, ...) are refused with 400
rather than ignored. A stop string ends the text before it, as in OpenAI's API. `max_tokens` defaults to
the server's `max_tokens` (OpenAI's completions default, 16, is too short to be useful). With `seed`,
sample j of a request uses stream (seed, j), so the same request gives the same text however the server
batched it; prompt i of a /v1/completions list uses seed + i.

Batching: FastAPI + uvicorn serve the HTTP side (async); one worker thread owns the engine. Requests that
arrive while the engine is busy join the running batch at its next step (continuous batching across
concurrent HTTP calls: the engine's `add_request` + `step`), so eight concurrent judge calls decode
together instead of one after another.
"""

from __future__ import annotations

import queue
import socket
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from posttrain.config import MODEL_HELP, Config, backend_field, chat_template_args_field, chat_template_field, parse_args
from posttrain.data.templates import render_prompt
from posttrain.errors import UserError
from posttrain.rollout.types import Request, RequestOutput, SamplingParams


class ServeConfig(Config):
    """Serve a model over an OpenAI-compatible HTTP API (chat and text completions) with the built-in engine."""

    model: str = Field("tiny-random", description=MODEL_HELP)
    backend: str = backend_field()
    chat_template: str = chat_template_field()
    chat_template_args: dict = chat_template_args_field()
    served_model_name: str = Field("", description="the name /v1/models lists and requests must use ('' = the model argument)")
    host: str = Field("127.0.0.1", description="interface to listen on (0.0.0.0: every interface; there is no authentication)")
    port: int = Field(8000, ge=0, le=65535, description="TCP port (0 = a free one, printed at start)")
    max_tokens: int = Field(256, ge=1, description="new tokens per sample when a request gives no max_tokens")
    dtype: str = Field("float32", description="model dtype: float32 | bfloat16")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="auto (cuda if a GPU is visible, else cpu) | cpu | cuda | cuda:N")
    max_num_seqs: int = Field(64, ge=1, description="sequences decoded together")
    max_model_len: int = Field(2048, ge=2, description="prompt + completion tokens per sequence")
    kv_cache_mb: float = Field(1024, gt=0, description="KV cache size in MiB")
    seed: int = Field(0, description="seed for requests that give none (drawn in arrival order)")


# ---------------------------------------------------------------- the engine's thread


@dataclass(eq=False)
class _Job:
    requests: list[Request]
    future: Future
    states: list = field(default_factory=list)


class EngineWorker:
    """One thread owns the engine. `submit(requests)` returns a Future of their RequestOutputs; requests
    submitted while others run are added to the running engine and decode with them (continuous batching)."""

    def __init__(self, engine):
        self.engine = engine
        self.inbox: queue.Queue = queue.Queue()
        self.broken: str | None = None
        self.served = 0  # requests finished
        self.peak_jobs = 0  # most HTTP calls decoding at once
        self.thread = threading.Thread(target=self._loop, name="posttrain-engine", daemon=True)
        self.thread.start()

    def submit(self, requests: list[Request]) -> Future:
        fut: Future = Future()
        if self.broken:
            fut.set_exception(RuntimeError(self.broken))
        else:
            self.inbox.put(_Job(requests, fut))
        return fut

    def close(self) -> None:
        self.inbox.put(None)
        self.thread.join(timeout=30)

    def _take(self, active: list[_Job]) -> bool:
        """Move arrived jobs into the engine (block while idle). False when closing."""
        try:
            job = self.inbox.get(block=not active)
        except queue.Empty:
            return True
        while job is not None:
            active.append(job)  # first: if adding fails, the job is answered with the error
            job.states = [self.engine.add_request(r, i) for i, r in enumerate(job.requests)]
            try:
                job = self.inbox.get_nowait()
            except queue.Empty:
                return True
        return False

    def _loop(self) -> None:
        active: list[_Job] = []
        running = True
        while running or active:
            try:
                if running:
                    running = self._take(active)
                self.peak_jobs = max(self.peak_jobs, len(active))
                if self.engine.has_work():
                    self.engine.step()
            except Exception as e:  # every caller gets the error; the engine is not trusted again
                self.broken = f"engine failed: {type(e).__name__}: {e}"
                for job in active:
                    job.future.set_exception(RuntimeError(self.broken))
                if running:
                    self._refuse_until_closed()
                return
            for job in [j for j in active if all(st.remaining == 0 for st in j.states)]:
                active.remove(job)
                self.served += len(job.requests)
                job.future.set_result([st.output for st in job.states])

    def _refuse_until_closed(self) -> None:
        """After a failure: answer every job still queued or yet to come with the error, until close()."""
        while (job := self.inbox.get()) is not None:
            job.future.set_exception(RuntimeError(self.broken))


# ---------------------------------------------------------------- the HTTP API


class _Body(BaseModel):
    """Keys both completion endpoints take; any other key is refused (400), never silently ignored."""

    model_config = ConfigDict(extra="forbid")
    model: str = ""
    n: int = Field(1, ge=1, le=256)
    temperature: float = Field(1.0, ge=0, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = Field(None, validate_default=True)
    stream: Literal[False] = Field(False, description="streaming is not implemented")
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4 or not all(stops):
            raise ValueError("stop: at most 4 non-empty strings")
        return stops


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(str(p.get("text", "")) for p in self.content if p.get("type", "text") == "text")


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionBody(_Body):
    prompt: str | list[str]


def _error(status: int, message: str, kind: str = "invalid_request_error"):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}}, status_code=status)


def _cut_at_stop(text: str, stops: list[str]) -> str:
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return text[:cut] if cut >= 0 else text


def make_app(worker: EngineWorker, tokenizer, served_name: str, default_max_tokens: int = 256):
    """The FastAPI application (see the module docstring); `worker` runs the engine."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError

    app = FastAPI(title="posttrain serve")

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request, exc):  # OpenAI answers 400 with an error object, not FastAPI's 422
        msg = "; ".join(f"{'.'.join(str(x) for x in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors())
        return _error(400, msg)

    async def run(body, prompts: list[list[int]]):
        if body.model and body.model != served_name:
            return None, _error(404, f"model '{body.model}' is not served here (this server serves '{served_name}')", "not_found_error")
        limit = body.max_completion_tokens or body.max_tokens or default_max_tokens
        reqs = [Request(ids, SamplingParams(n=body.n, temperature=body.temperature, top_p=body.top_p, max_new_tokens=limit,
                                            stop_strings=list(body.stop), seed=None if body.seed is None else body.seed + i), i)
                for i, ids in enumerate(prompts)]
        import asyncio

        try:
            outs: list[RequestOutput] = await asyncio.wrap_future(worker.submit(reqs))
        except RuntimeError as e:
            return None, _error(503, str(e), "server_error")
        bad = [o.error for o in outs if o.error]
        return (None, _error(400, bad[0])) if bad else (outs, None)

    def envelope(kind: str, choices: list, outs: list[RequestOutput]) -> dict:
        completion = sum(len(s.token_ids) for o in outs for s in o.samples)
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        return {"id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}", "object": kind,
                "created": int(time.time()), "model": served_name, "choices": choices,
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}

    @app.get("/health")
    async def health():
        return {"status": "broken" if worker.broken else "ok", "model": served_name, "requests_served": worker.served,
                "peak_concurrent_calls": worker.peak_jobs, "error": worker.broken}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_name, "object": "model", "created": 0, "owned_by": "posttrain"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody):
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        try:
            ids = render_prompt(tokenizer, messages)
        except Exception as e:  # a template that refuses these messages is the caller's problem
            return _error(400, f"messages: the chat template refused them: {type(e).__name__}: {e}")
        outs, err = await run(body, [ids])
        if err is not None:
            return err
        choices = [{"index": s.index, "message": {"role": "assistant", "content": _cut_at_stop(s.text or "", body.stop)},
                    "finish_reason": s.finish_reason, "logprobs": None} for s in outs[0].samples]
        return envelope("chat.completion", choices, outs)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if not prompts or not all(prompts):
            return _error(400, "prompt: give a non-empty string or a list of non-empty strings")
        outs, err = await run(body, [render_prompt(tokenizer, p) for p in prompts])
        if err is not None:
            return err
        choices = [{"index": i * body.n + s.index, "text": _cut_at_stop(s.text or "", body.stop), "finish_reason": s.finish_reason,
                    "logprobs": None} for i, o in enumerate(outs) for s in o.samples]
        return envelope("text_completion", choices, outs)

    return app


# ---------------------------------------------------------------- running it


def _uvicorn():
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise UserError(f"posttrain serve needs FastAPI and uvicorn: pip install 'posttrain[serve]' ({e})") from None
    return uvicorn


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready socket (port 0: a free one, read back with getsockname)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {e}") from None
    return sock


class ServerThread:
    """Run an ASGI app with uvicorn in a background thread on a free localhost port (tests, notebooks).

        with ServerThread(app) as srv:
            httpx.get(srv.base_url + "/models")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        uvicorn = _uvicorn()
        self.sock = bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server thread did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def build_worker(cfg: ServeConfig):
    from posttrain.models.loading import load_model, load_tokenizer  # torch: not for --help
    from posttrain.rollout.backends import StepAdapter, build_backend
    from posttrain.rollout.engine import Engine, EngineConfig

    tok = load_tokenizer(cfg.model, cfg.chat_template, cfg.chat_template_args)
    ecfg = EngineConfig(max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len, kv_cache_mb=cfg.kv_cache_mb, seed=cfg.seed)
    model = None if cfg.backend == "vllm" else load_model(cfg.model, dtype=cfg.dtype, device=cfg.device).eval()
    backend = build_backend(cfg.backend, model, tok, ecfg, model_name=cfg.model, dtype=cfg.dtype)
    return EngineWorker(backend if isinstance(backend, Engine) else StepAdapter(backend)), tok


def main(argv: list[str]) -> None:
    cfg = parse_args(ServeConfig, argv, prog="posttrain serve")
    uvicorn = _uvicorn()
    sock = bind(cfg.host, cfg.port)  # refuse a taken port before the model loads
    worker, tok = build_worker(cfg)
    name = cfg.served_model_name or cfg.model
    app = make_app(worker, tok, name, cfg.max_tokens)
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    print(f"posttrain serve: {name} at http://{host}:{sock.getsockname()[1]}/v1 (Ctrl-C stops)", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2, lifespan="off"))
    try:
        server.run(sockets=[sock])
    finally:
        worker.close()
        sock.close()
    sys.stdout.flush()
