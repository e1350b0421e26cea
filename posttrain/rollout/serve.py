"""`posttrain serve model=… port=…`: an OpenAI-compatible server over the built-in engine (or HF / vLLM), so a
local model can judge (`reward=judge`, `posttrain label`), be judged, or be evaluated by anything that speaks the
OpenAI API (the `openai` SDK, lm-evaluation-harness's `local-completions` / `local-chat-completions`).

    GET  /v1/models, /v1/models/{id}   the one served model
    POST /v1/chat/completions          messages (+ tools) -> the chat template (generation prompt) -> n samples
    POST /v1/completions               prompt: a string, a list of strings, token ids or a list of token-id lists
                                       (no chat template) -> n samples each
    GET  /health

What each request key does, and which are accepted only at their no-op defaults: rollout/openai_protocol.py
and docs/judge.md. Streaming (`stream=true`, server-sent events, `stream_options.include_usage`), `logprobs`
(completions: an int, the shape {tokens, token_logprobs, top_logprobs, text_offset}; chat: `logprobs=true` and
`top_logprobs`), `echo` (the prompt's own log-probs: `echo=true, max_tokens=0, logprobs=1` scores a text, what
lm-eval's log-likelihood tasks send), `top_k`, `seed`, `stop`. Log-probs are the model's own: log_softmax of its
raw logits (temperature 1, before top-k / top-p), for sampled tokens as OpenAI and vLLM report them, for prompt
tokens from one forward of the whole prompt (rollout/scoring.py). Errors are OpenAI's shape
{"error": {"message", "type", "param", "code"}}: 400 for a bad request (a key this server does not implement
at a non-default value, a prompt or max_tokens beyond the context), 404 for an unknown model or route.

`max_tokens` defaults to the server's `max_tokens` (OpenAI's completions default, 16, is too short to be
useful), capped at what the context leaves; an explicit value beyond the context is refused. With `seed`,
sample j of a request uses stream (seed, j), so the same request gives the same text however the server
batched it; prompt i of a /v1/completions list uses seed + i.

Batching: FastAPI + uvicorn serve the HTTP side (async); one worker thread owns the engine. Requests that
arrive while the engine is busy join the running batch at its next step (continuous batching across
concurrent HTTP calls: the engine's `add_request` + `step`), so eight concurrent judge calls decode
together instead of one after another. A streamed request is read after every step (`Engine.snapshot`).

Test-time selection (`select=best_of_n|majority n=N reward=…`, rollout/select.py): each returned choice is the
one kept among N samples drawn for it (a request's `n` choices draw n·N); `usage.completion_tokens` counts all
of them, and each choice carries `selection` {method, n, index, rewards | answers, classes, votes}. A request
carries no reference answer, so best_of_n takes a reward that reads no dataset column (`rm:PATH`, a file
reward); majority votes with the math verifier's extraction. Streaming is refused with select (the choice
needs every sample finished).
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from pydantic import Field

from posttrain.config import MODEL_HELP, Config, backend_field, chat_template_args_field, chat_template_field, parse_args
from posttrain.data.templates import render_prompt
from posttrain.errors import UserError
from posttrain.rollout.openai_protocol import (
    APIError,
    ChatBody,
    CompletionBody,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    context_error,
    cut_at_stop,
    held_back,
    parse_tool_calls,
    sse,
    tool_call_format,
    validation_error,
)
from posttrain.rollout.select import HELP as SELECT_HELP
from posttrain.rollout.select import check_select
from posttrain.rollout.types import Completion, Request, RequestOutput, SamplingParams


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
    select: str = Field("", description=SELECT_HELP)
    n: int = Field(1, ge=1, description="select=: samples drawn per returned choice")
    reward: str = Field("", description="select=: rm:PATH (or a reward reading no dataset column) for best_of_n; math for majority")
    reward_args: dict = Field(default_factory=dict, description="options per reward, e.g. {math: {mode: last_number}}")


# ---------------------------------------------------------------- the engine's thread


@dataclass(eq=False)
class _Job:
    requests: list[Request]
    future: Future
    states: list = field(default_factory=list)
    listener: Callable | None = None  # called (on the engine thread) with `EngineWorker.progress` after every step


class EngineWorker:
    """One thread owns the engine. `submit(requests)` returns a Future of their RequestOutputs; requests
    submitted while others run are added to the running engine and decode with them (continuous batching)."""

    def __init__(self, engine):
        self.engine = engine
        self.max_model_len: int | None = getattr(engine, "max_model_len", None)  # None: not checked here
        self.vocab_size: int | None = getattr(engine, "vocab_size", None)
        self.default_eos: list[int] | None = getattr(engine, "default_eos", None)
        self.inbox: queue.Queue = queue.Queue()
        self.broken: str | None = None
        self.served = 0  # requests finished
        self.peak_jobs = 0  # most HTTP calls decoding at once
        self.thread = threading.Thread(target=self._loop, name="posttrain-engine", daemon=True)
        self.thread.start()

    def submit(self, requests: list[Request], listener: Callable | None = None) -> Future:
        """`listener(progress)`, if given, is called on the engine thread after every step while the requests run
        (see `progress`); it must only hand the value over (e.g. `loop.call_soon_threadsafe`)."""
        fut: Future = Future()
        if self.broken:
            fut.set_exception(RuntimeError(self.broken))
        else:
            self.inbox.put(_Job(requests, fut, listener=listener))
        return fut

    def progress(self, job: _Job) -> list[tuple[list | None, list[Completion | None]]] | None:
        """Per request of `job`: (its prompt log-probs once computed, what each sample has so far: Engine.snapshot);
        None for an engine that cannot tell before it finishes."""
        snap = getattr(self.engine, "snapshot", None)
        if snap is None:
            return None
        return [(getattr(getattr(st, "output", None), "prompt_logprobs", None), snap(st)) for st in job.states]

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
                    for job in active:
                        if job.listener is not None and any(st.remaining for st in job.states):
                            self._tell(job)
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

    def _tell(self, job: _Job) -> None:
        progress = self.progress(job)
        if progress is not None:
            try:
                job.listener(progress)
            except Exception:  # a listener that fails (its client went away) must not stop the engine
                job.listener = None

    def _refuse_until_closed(self) -> None:
        """After a failure: answer every job still queued or yet to come with the error, until close()."""
        while (job := self.inbox.get()) is not None:
            job.future.set_exception(RuntimeError(self.broken))


# ---------------------------------------------------------------- the HTTP API


@dataclass
class _Prompt:
    """One prompt of a call: its token ids, the text `echo` returns, and the completion budget."""

    ids: list[int]
    text: str
    max_new: int


class _Api:
    """What the routes share: the worker, the tokenizer, the served name; request -> engine Requests -> OpenAI JSON."""

    def __init__(self, worker: EngineWorker, tokenizer, served_name: str, default_max_tokens: int, selector=None, select_n: int = 1):
        self.worker, self.tok, self.name, self.default_max_tokens = worker, tokenizer, served_name, default_max_tokens
        self.selector, self.select_n = selector, select_n if selector is not None else 1
        self.token_text = TokenText(tokenizer)
        template = getattr(tokenizer, "chat_template", None)
        self.tool_format = tool_call_format(template if isinstance(template, str) else None)

    # ------------------------------------------------------------ requests
    def check_model(self, body) -> None:
        if body.model and body.model != self.name:
            raise APIError(404, f"The model '{body.model}' does not exist: this server serves '{self.name}'", "model",
                           "model_not_found")

    def budget(self, ids: list[int], asked: int | None, param: str, scoring_ok: bool) -> int:
        """New tokens for a prompt of len(ids): `asked`, or the server's default capped at what the context leaves.
        Raises 400 for a prompt or an asked max_tokens beyond the context."""
        vocab = self.worker.vocab_size or len(self.tok)
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise APIError(400, f"{param}: token ids must be integers in [0, {vocab})", param)
        limit = self.worker.max_model_len
        if limit is None:
            return self.default_max_tokens if asked is None else asked
        P = len(ids)
        if asked is not None:
            if P + asked > limit or (asked == 0 and not scoring_ok):
                raise context_error(limit, P, asked, "max_tokens" if P <= limit else param)
            return asked
        if P >= limit:
            raise context_error(limit, P, None, param)
        return min(self.default_max_tokens, limit - P)

    def sampling(self, body, max_new: int, seed: int | None, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
        stop_ids = None
        if body.stop_token_ids:  # vLLM's meaning: stop at these too, besides the model's own end-of-sequence ids
            stop_ids = list(dict.fromkeys([*(self.worker.default_eos or []), *body.stop_token_ids]))
        return SamplingParams(n=body.n * self.select_n, temperature=1.0 if body.temperature is None else body.temperature,
                              top_p=1.0 if body.top_p is None else body.top_p, top_k=max(0, body.top_k or 0),
                              max_new_tokens=max_new, stop_token_ids=stop_ids, stop_strings=list(body.stop),
                              ignore_eos=body.ignore_eos, seed=seed, logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def completion_prompts(self, body: CompletionBody) -> list[_Prompt]:
        out = []
        for p in body.prompts():
            ids = render_prompt(self.tok, p) if isinstance(p, str) else list(p)
            if not ids:
                raise APIError(400, "prompt: it tokenizes to no tokens", "prompt")
            max_new = self.budget(ids, body.max_tokens, "prompt", scoring_ok=True)
            text = p if isinstance(p, str) else (self.tok.decode(ids) if body.echo else "")
            out.append(_Prompt(ids, text, max_new))
        return out

    def chat_prompt(self, body: ChatBody) -> tuple[_Prompt, bool]:
        """(the rendered prompt, whether tool calls are parsed from the reply)."""
        messages = [m.for_template(i) for i, m in enumerate(body.messages)]
        kw = dict(body.chat_template_kwargs or {})
        if body.continue_final_message:
            kw["continue_final_message"] = True
        tools = body.tools if body.tools and body.tool_choice != "none" else None
        try:
            ids = render_prompt(self.tok, messages, body.add_generation_prompt, **kw, **({"tools": tools} if tools else {}))
            if tools and ids == render_prompt(self.tok, messages, body.add_generation_prompt, **kw):
                raise APIError(400, "tools: this model's chat template does not render tools (it gives the same prompt "
                               "with and without them); serve a model whose template takes `tools`, or give "
                               "chat_template= one that does", "tools", "unsupported_value")
        except APIError:
            raise
        except Exception as e:  # a template that refuses these messages is the caller's problem
            raise APIError(400, f"messages: the chat template refused them: {type(e).__name__}: {e}", "messages") from None
        if not ids:
            raise APIError(400, "messages: the chat template renders them to no tokens", "messages")
        return _Prompt(ids, "", self.budget(ids, body.completion_limit, "messages", scoring_ok=False)), bool(tools and self.tool_format)

    async def generate(self, requests: list[Request], listener=None) -> list[RequestOutput]:
        try:
            outs: list[RequestOutput] = await asyncio.wrap_future(self.worker.submit(requests, listener))
        except RuntimeError as e:
            raise APIError(503, str(e), None, None, "server_error") from None
        bad = [o.error for o in outs if o.error]
        if bad:
            raise APIError(400, bad[0])
        return outs

    def check_stream(self, body) -> None:
        if body.stream and self.selector is not None:
            raise APIError(400, f"stream=true: this server keeps one of {self.select_n} samples per choice "
                           f"(select={self.selector.method}), which needs every sample finished; send stream=false", "stream")

    async def selected(self, body, prompts: list, outs: list[RequestOutput]) -> tuple[list[RequestOutput], list[list[dict]]]:
        """With select=: each request's n·N samples -> its n kept ones (indices 0..n−1) and their `selection` records;
        without: the outputs as they are. `prompts`: what the reward sees per request (a conversation or a string)."""
        if self.selector is None:
            return outs, [[{} for _ in o.samples] for o in outs]
        N = self.select_n
        groups = [(p, {}, [self.text(c, body)[0] for c in o.samples[j * N:(j + 1) * N]],
                   [list(c.token_ids) for c in o.samples[j * N:(j + 1) * N]])
                  for p, o in zip(prompts, outs) for j in range(body.n)]
        choices = await asyncio.to_thread(self.selector.choose, groups)  # a reward model's forward: off the event loop
        kept, records, at = [], [], 0
        for o in outs:
            mine = choices[at:at + body.n]
            samples = [dataclasses.replace(o.samples[j * N + ch.index], index=j) for j, ch in enumerate(mine)]
            kept.append(dataclasses.replace(o, samples=samples))
            records.append([ch.record(self.selector.method) for ch in mine])
            at += body.n
        return kept, records

    # ------------------------------------------------------------ responses
    def text(self, c: Completion, body) -> tuple[str, str]:
        """(the completion's text as returned, finish_reason): cut before the first stop string (through it with
        include_stop_str_in_output), as OpenAI does."""
        text = self.tok.decode(c.token_ids, skip_special_tokens=body.skip_special_tokens)
        text, hit = cut_at_stop(text, body.stop, body.include_stop_str_in_output)
        return text, "stop" if hit else (c.finish_reason or "length")

    def envelope(self, kind: str, cid: str, created: int, choices: list, outs: list[RequestOutput]) -> dict:
        return {"id": cid, "object": kind, "created": created, "model": self.name, "choices": choices,
                "usage": self.usage(outs), "system_fingerprint": None}

    @staticmethod
    def usage(outs: list[RequestOutput]) -> dict:
        completion = sum(len(s.token_ids) for o in outs for s in o.samples)
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def completion_choice(self, body: CompletionBody, index: int, prompt: _Prompt, out: RequestOutput, c: Completion) -> dict:
        text, finish = self.text(c, body)
        lp = None
        if body.logprobs is not None:
            ids, lps = list(c.token_ids), list(c.model_logprobs or [])
            if body.echo:
                ids, lps = prompt.ids + ids, list(out.prompt_logprobs or [None] * len(prompt.ids)) + lps
            lp, _ = completion_logprobs(ids, lps, self.token_text)
        return {"index": index, "text": (prompt.text if body.echo else "") + text, "logprobs": lp, "finish_reason": finish}

    def chat_choice(self, body: ChatBody, c: Completion, tools: bool) -> dict:
        text, finish = self.text(c, body)
        message: dict = {"role": "assistant", "content": text, "refusal": None}
        if tools:
            content, calls = parse_tool_calls(text)
            if calls:
                message.update(content=content, tool_calls=calls)
                finish = "tool_calls"
        lp = {"content": chat_logprobs(c.token_ids, list(c.model_logprobs or []), self.token_text),
              "refusal": None} if body.logprobs else None
        return {"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish}


class _Streamer:
    """Server-sent events for one call: per choice, text deltas that never have to be taken back (held until a
    stop string or an incomplete character is resolved), each chunk with the log-probs of its new tokens."""

    def __init__(self, api: _Api, body, chat: bool, prompts: list[_Prompt], cid: str, created: int):
        self.api, self.body, self.chat, self.prompts = api, body, chat, prompts
        self.head = {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                     "model": api.name, "system_fingerprint": None}
        n = body.n
        self.sent_text = [""] * (len(prompts) * n)
        self.sent_tokens = [0] * (len(prompts) * n)
        self.offset = [0] * (len(prompts) * n)  # text_offset of the next token (completions logprobs)
        self.echoed = [not (not chat and body.echo)] * (len(prompts) * n)
        self.done = [False] * (len(prompts) * n)

    def chunk(self, choices: list[dict], usage: dict | None = None, with_usage: bool = False) -> str:
        obj = {**self.head, "choices": choices}
        if self.body.include_usage:
            obj["usage"] = usage if with_usage else None
        return sse(obj)

    def start(self) -> list[str]:
        if not self.chat:
            return []
        return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
                for i in range(len(self.sent_text))]

    def _echo(self, i: int, prompt: _Prompt, prompt_lps) -> dict | None:
        """Completions with echo: the prompt (and its log-probs) first, once they are known."""
        if self.echoed[i]:
            return None
        lp = None
        if self.body.logprobs is not None:
            if prompt_lps is None:
                return None
            lp, self.offset[i] = completion_logprobs(prompt.ids, prompt_lps, self.api.token_text)
        self.echoed[i] = True
        return {"index": i, "text": prompt.text, "logprobs": lp, "finish_reason": None}

    def _delta(self, i: int, c: Completion, final: bool) -> tuple[dict | None, str | None]:
        """(the choice's chunk with what is new, its finish_reason when `final`)."""
        body, toks = self.body, list(c.token_ids)
        lps = list(c.model_logprobs or [])
        if final:
            visible, finish = self.api.text(c, body)
        else:
            text = self.api.tok.decode(toks, skip_special_tokens=body.skip_special_tokens)
            visible, hit = cut_at_stop(text, body.stop, body.include_stop_str_in_output)
            if not hit:
                visible = visible[:len(visible) - held_back(visible, body.stop)]
            finish = None
        sent = self.sent_text[i]
        delta = visible[len(sent):] if (final or visible.startswith(sent)) else ""
        wants_lp = body.logprobs not in (None, False)
        upto = len(toks) if (final or not wants_lp) else min(len(toks), len(lps))
        new_toks, new_lps = toks[self.sent_tokens[i]:upto], lps[self.sent_tokens[i]:upto]
        if not delta and not new_toks:
            return None, finish
        self.sent_text[i] += delta
        self.sent_tokens[i] = max(self.sent_tokens[i], upto)
        lp = None
        if wants_lp and new_toks:
            if self.chat:
                lp = {"content": chat_logprobs(new_toks, new_lps, self.api.token_text), "refusal": None}
            else:
                lp, self.offset[i] = completion_logprobs(new_toks, new_lps, self.api.token_text, self.offset[i])
        if not delta and lp is None:
            return None, finish
        if self.chat:
            return {"index": i, "delta": {"content": delta}, "logprobs": lp, "finish_reason": None}, finish
        return {"index": i, "text": delta, "logprobs": lp, "finish_reason": None}, finish

    def update(self, progress, final_outs: list[RequestOutput] | None = None) -> list[str]:
        """Chunks for what changed since the last update (`progress`: EngineWorker.progress, or the final outputs)."""
        items = [(o.prompt_logprobs, list(o.samples)) for o in final_outs] if final_outs is not None else progress
        choices, finishes = [], []
        for p, (prompt_lps, samples) in enumerate(items):
            for j, c in enumerate(samples):
                i = p * self.body.n + j
                if self.done[i]:
                    continue
                if (echo := self._echo(i, self.prompts[p], prompt_lps)) is not None:
                    choices.append(echo)
                if c is None or not self.echoed[i]:
                    continue
                final = final_outs is not None or c.finish_reason is not None
                ch, finish = self._delta(i, c, final)
                if ch is not None:
                    choices.append(ch)
                if final:
                    self.done[i] = True
                    finishes.append((i, finish))
        out = [self.chunk([ch]) for ch in choices]
        for i, finish in finishes:
            empty = {"delta": {}} if self.chat else {"text": ""}
            out.append(self.chunk([{"index": i, **empty, "logprobs": None, "finish_reason": finish}]))
        return out

    def tool_reply(self, outs: list[RequestOutput]) -> list[str]:
        """Chat with tool parsing: the whole reply of each choice at once (calls are parsed from the finished text)."""
        out = []
        for c in outs[0].samples:
            ch = self.api.chat_choice(self.body, c, tools=True)
            msg, delta = ch["message"], {}
            if msg.get("content"):
                delta["content"] = msg["content"]
            if msg.get("tool_calls"):
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(msg["tool_calls"])]
            out.append(self.chunk([{"index": c.index, "delta": delta, "logprobs": ch["logprobs"], "finish_reason": None}]))
            out.append(self.chunk([{"index": c.index, "delta": {}, "logprobs": None, "finish_reason": ch["finish_reason"]}]))
        return out

    async def run(self, requests: list[Request], tools: bool = False):
        """The event stream: chunks as the engine steps, then finish reasons, usage (include_usage) and [DONE]."""
        loop = asyncio.get_running_loop()
        latest: dict = {}
        wake = asyncio.Event()

        def hand_over(progress):  # engine thread -> event loop; only the newest progress matters
            latest["p"] = progress
            loop.call_soon_threadsafe(wake.set)

        fut = self.api.worker.submit(requests, None if tools else hand_over)
        fut.add_done_callback(lambda _f: loop.call_soon_threadsafe(wake.set))
        for line in self.start():
            yield line
        try:
            while not fut.done():
                await wake.wait()
                wake.clear()
                if "p" in latest and not fut.done():
                    for line in self.update(latest.pop("p")):
                        yield line
            try:
                outs = fut.result()
            except RuntimeError as e:
                raise APIError(503, str(e), None, None, "server_error") from None
            bad = [o.error for o in outs if o.error]
            if bad:
                raise APIError(400, bad[0])
            for line in (self.tool_reply(outs) if tools else self.update(None, outs)):
                yield line
            if self.body.include_usage:
                yield self.chunk([], self.api.usage(outs), with_usage=True)
        except APIError as e:
            yield sse(e.body())
        except Exception as e:  # a bug must still end the stream with an error the client can read
            yield sse(APIError(500, f"internal error: {type(e).__name__}: {e}", None, None, "server_error").body())
        yield "data: [DONE]\n\n"


def _install_error_handlers(app) -> None:
    """Every error in OpenAI's shape: 400 (never FastAPI's 422) for a bad body, 404 for an unknown route."""
    from fastapi import Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    def error(e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error(exc)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request, exc):
        return error(validation_error(exc.errors()))

    @app.exception_handler(HTTPException)
    async def _http_error(request: HTTPRequest, exc: HTTPException):
        if exc.status_code == 404:
            return error(APIError(404, f"Invalid URL ({request.method} {request.url.path})"))
        if exc.status_code == 405:
            return error(APIError(405, f"Method not allowed ({request.method} {request.url.path})"))
        return error(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _server_error(request, exc: Exception):
        return error(APIError(500, f"internal error: {type(exc).__name__}: {exc}", None, None, "server_error"))


def make_app(worker: EngineWorker, tokenizer, served_name: str, default_max_tokens: int = 256, selector=None, select_n: int = 1):
    """The FastAPI application (see the module docstring); `worker` runs the engine; `selector` (rollout/select.py
    Selector) keeps one of `select_n` samples per choice."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI(title="posttrain serve")
    _install_error_handlers(app)
    api = _Api(worker, tokenizer, served_name, default_max_tokens, selector, select_n)

    def model_card() -> dict:
        return {"id": served_name, "object": "model", "created": 0, "owned_by": "posttrain"}

    @app.get("/health")
    async def health():
        return {"status": "broken" if worker.broken else "ok", "model": served_name, "requests_served": worker.served,
                "peak_concurrent_calls": worker.peak_jobs, "error": worker.broken}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != served_name:
            raise APIError(404, f"The model '{model_id}' does not exist: this server serves '{served_name}'", "model",
                           "model_not_found")
        return model_card()

    def stream(streamer: _Streamer, requests: list[Request], tools: bool = False):
        return StreamingResponse(streamer.run(requests, tools), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody):
        api.check_model(body)
        body.check_noops()
        api.check_stream(body)
        prompt, tools = api.chat_prompt(body)
        k = (body.top_logprobs or 0) if body.logprobs else None
        reqs = [Request(prompt.ids, api.sampling(body, prompt.max_new, body.seed, k, None), 0)]
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return stream(_Streamer(api, body, True, [prompt], cid, created), reqs, tools)
        outs = await api.generate(reqs)
        kept, records = await api.selected(body, [[m.for_template(i) for i, m in enumerate(body.messages)]], outs)
        choices = [{**api.chat_choice(body, c, tools), **({"selection": r} if r else {})} for c, r in zip(kept[0].samples, records[0])]
        return api.envelope("chat.completion", cid, created, choices, outs)  # usage: every sample drawn

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        api.check_model(body)
        body.check_noops()
        api.check_stream(body)
        prompts = api.completion_prompts(body)
        k = body.logprobs
        reqs = [Request(p.ids, api.sampling(body, p.max_new, None if body.seed is None else body.seed + i, k,
                                            k if body.echo else None), i)
                for i, p in enumerate(prompts)]
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return stream(_Streamer(api, body, False, prompts, cid, created), reqs)
        outs = await api.generate(reqs)
        kept, records = await api.selected(body, [p.text or api.tok.decode(p.ids) for p in prompts], outs)
        choices = [{**api.completion_choice(body, i * body.n + c.index, p, o, c), **({"selection": r} if r else {})}
                   for i, (p, o, rs) in enumerate(zip(prompts, kept, records)) for c, r in zip(o.samples, rs)]
        return api.envelope("text_completion", cid, created, choices, outs)  # usage: every sample drawn

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
    # vLLM reports the model's raw log-probs here (as its own server does), not the sampling distribution RL needs
    extra = {"logprobs_mode": "raw_logprobs"} if cfg.backend == "vllm" else {}
    backend = build_backend(cfg.backend, model, tok, ecfg, model_name=cfg.model, dtype=cfg.dtype, **extra)
    return EngineWorker(backend if isinstance(backend, Engine) else StepAdapter(backend)), tok


def build_selector(cfg: ServeConfig):
    """The server's Selector (None without select=); a reward that needs dataset columns is refused: requests carry none."""
    check_select(cfg.select, cfg.n, cfg.reward)
    if not cfg.select:
        return None
    from posttrain.rewards.pool import default_pool
    from posttrain.rollout.select import Selector

    sel = Selector(cfg.select, cfg.reward, cfg.reward_args, default_pool(), cfg.n)
    if sel.columns:
        cols = sorted({c if isinstance(c, str) else "|".join(c) for cs in sel.columns.values() for c in cs})
        raise UserError(f"serve select=best_of_n reward={cfg.reward}: it reads the dataset column(s) {', '.join(cols)}, which a "
                        "request does not carry; rank by a reward model (reward=rm:PATH) or use select=majority reward=math")
    return sel


def main(argv: list[str]) -> None:
    cfg = parse_args(ServeConfig, argv, prog="posttrain serve")
    uvicorn = _uvicorn()
    selector = build_selector(cfg)  # misuse refused before the port and the model
    sock = bind(cfg.host, cfg.port)  # refuse a taken port before the model loads
    worker, tok = build_worker(cfg)
    name = cfg.served_model_name or cfg.model
    app = make_app(worker, tok, name, cfg.max_tokens, selector, cfg.n)
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    print(f"posttrain serve: {name} at http://{host}:{sock.getsockname()[1]}/v1 (Ctrl-C stops)", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2, lifespan="off"))
    try:
        server.run(sockets=[sock])
    finally:
        worker.close()
        sock.close()
    sys.stdout.flush()
