"""A fake OpenAI-compatible judge that misbehaves on purpose, served over real HTTP (uvicorn in a thread).

Behaviour (attributes of `FakeJudge`, changed by tests between calls):
  verdict   "longer": the longer response wins (a content judge); "first": always [[A]] (pure position
            bias); "second": always [[B]]
  score     rating = clamp(1 + len(response) // 10, 1, 10), replied as "Rating: [[k]]"
  malformed_first  the first k replies to each distinct question are prose without a verdict
  status_first     the first k replies to each distinct question are HTTP `status` errors
  delay_s          every reply waits this long (async: other calls are not blocked)
Every request body is recorded in `requests`.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from posttrain.rollout.serve import ServerThread

PAIR = re.compile(r"\[Response A\]\n(.*?)\n\[End of Response A\]\n\n\[Response B\]\n(.*?)\n\[End of Response B\]", re.S)
SINGLE = re.compile(r"\[Response\]\n(.*?)\n\[End of Response\]", re.S)


class FakeJudge:
    def __init__(self):
        self.verdict = "longer"
        self.malformed_first = 0
        self.status_first = 0
        self.status = 500
        self.delay_s = 0.0
        self.requests: list[dict] = []
        self.seen: Counter = Counter()
        self.app = self._app()

    def reply(self, content: str) -> str:
        m = PAIR.search(content)
        if m:
            a, b = m.group(1), m.group(2)
            if self.verdict == "first":
                return "[[A]]"
            if self.verdict == "second":
                return "[[B]]"
            return "Response A is longer and so better. [[A]]" if len(a) > len(b) else "B says more. [[B]]"
        m = SINGLE.search(content)
        if m:
            return f"Rating: [[{max(1, min(10, 1 + len(m.group(1)) // 10))}]]"
        return "I cannot tell what you are asking."

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "fake-judge", "object": "model"}]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.requests.append(body)
            content = body["messages"][-1]["content"]
            self.seen[content] += 1
            k = self.seen[content]
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if k <= self.status_first:
                return JSONResponse({"error": {"message": "overloaded"}}, status_code=self.status)
            text = "Both responses have merits; it is hard to say." if k <= self.status_first + self.malformed_first else self.reply(content)
            return {"id": "x", "object": "chat.completion", "model": body.get("model", ""),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": len(content) // 4, "completion_tokens": len(text) // 4}}

        return app

    def serve(self) -> ServerThread:
        return ServerThread(self.app)
