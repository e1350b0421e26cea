"""Fuzz cases for `posttrain serve` (#28): malformed and unusual request bodies, sent to the app in-process.

Each case is classified like tests/edges.py's: *works* (200 and a well-formed reply) or *clear error* (a 4xx in
OpenAI's shape {"error": {message, type, param, code}} whose `param` or message names the field) — never a 500,
never FastAPI's 422 {"detail": ...}.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from edges import ERROR, WORKS, ids

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "Say hi"}]


@dataclass
class Req:
    id: str
    path: str
    body: object  # dict / list (sent as JSON) or bytes (sent as they are)
    expect: str = ERROR
    param: str | None = None  # the error's `param`, or a word its message must contain
    status: int = 400
    choices: int = 1  # for WORKS: how many choices the reply has


CASES = [
    # ---- bodies that are not what the endpoint reads
    Req("not-json", TEXT, b"{not json"),
    Req("json-array", TEXT, [1, 2]),
    Req("json-string", CHAT, "hello"),
    Req("empty-body", CHAT, b""),
    Req("chat-no-messages", CHAT, {"max_tokens": 2}, param="messages"),
    Req("chat-empty-messages", CHAT, {"messages": [], "max_tokens": 2}, param="messages"),
    Req("chat-messages-a-string", CHAT, {"messages": "hi", "max_tokens": 2}, param="messages"),
    Req("chat-message-not-object", CHAT, {"messages": ["hi"], "max_tokens": 2}, param="messages.[0]"),
    Req("chat-unknown-role", CHAT, {"messages": [{"role": "wizard", "content": "x"}], "max_tokens": 2}, param="messages.[0].role"),
    Req("chat-content-a-number", CHAT, {"messages": [{"role": "user", "content": 5}], "max_tokens": 2}, param="messages.[0].content"),
    Req("chat-content-part-not-object", CHAT, {"messages": [{"role": "user", "content": ["x"]}], "max_tokens": 2},
        param="messages.[0].content"),
    Req("chat-tool-call-function-a-string", CHAT, {"messages": [*HI, {"role": "assistant", "content": "",
                                                                       "tool_calls": [{"function": "f"}]}], "max_tokens": 2},
        param="messages.[1].tool_calls"),
    Req("chat-tool-call-not-object", CHAT, {"messages": [*HI, {"role": "assistant", "content": "", "tool_calls": [5]}],
                                            "max_tokens": 2}, param="messages.[1].tool_calls"),
    Req("chat-lone-surrogate", CHAT, b'{"messages": [{"role": "user", "content": "a \\ud800 b"}], "max_tokens": 2}',
        param="messages.[0].content"),
    Req("completion-lone-surrogate", TEXT, b'{"prompt": "x \\udfff", "max_tokens": 2}', param="prompt"),
    Req("stop-lone-surrogate", TEXT, b'{"prompt": "x", "stop": ["\\ud800"], "max_tokens": 2}', param="stop"),
    Req("not-utf8-bytes", TEXT, b'{"prompt": "caf\xe9", "max_tokens": 2}'),
    Req("surrogate-in-content-part", CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}], '
                                           b'"max_tokens": 2}', param="messages.[0].content.[0].text"),
    Req("surrogate-in-prompt-list", TEXT, b'{"prompt": ["ok", "\\ud800"], "max_tokens": 2}', param="prompt.[1]"),
    Req("chat-template-kwargs-not-object", CHAT, {"messages": HI, "max_tokens": 2, "chat_template_kwargs": [1]},
        param="chat_template_kwargs"),
    # ---- values out of range
    Req("n-zero", TEXT, {"prompt": "x", "n": 0, "max_tokens": 2}, param="n"),
    Req("n-a-float", TEXT, {"prompt": "x", "n": 1.5, "max_tokens": 2}, param="n"),
    Req("temperature-negative", TEXT, {"prompt": "x", "temperature": -1, "max_tokens": 2}, param="temperature"),
    Req("top-p-zero", TEXT, {"prompt": "x", "top_p": 0, "max_tokens": 2}, param="top_p"),
    Req("max-tokens-negative", TEXT, {"prompt": "x", "max_tokens": -1}, param="max_tokens"),
    Req("max-tokens-a-string", TEXT, {"prompt": "x", "max_tokens": "ten"}, param="max_tokens"),
    Req("chat-max-tokens-zero", CHAT, {"messages": HI, "max_tokens": 0}, param="max_tokens"),
    Req("prompt-empty-string", TEXT, {"prompt": "", "max_tokens": 2}, param="prompt"),
    Req("prompt-empty-list", TEXT, {"prompt": [], "max_tokens": 2}, param="prompt"),
    Req("prompt-empty-token-list", TEXT, {"prompt": [[]], "max_tokens": 2}, param="prompt"),
    Req("prompt-negative-token", TEXT, {"prompt": [1, -3], "max_tokens": 2}, param="prompt"),
    Req("prompt-mixed-list", TEXT, {"prompt": ["x", 3], "max_tokens": 2}, param="prompt"),
    Req("prompt-a-dict", TEXT, {"prompt": {"text": "x"}, "max_tokens": 2}, param="prompt"),
    Req("prompt-too-long", TEXT, {"prompt": "word " * 400, "max_tokens": 2}, param="prompt"),
    Req("stop-empty-string", TEXT, {"prompt": "x", "stop": "", "max_tokens": 2}, param="stop"),
    Req("stop-a-number", TEXT, {"prompt": "x", "stop": [3], "max_tokens": 2}, param="stop"),
    Req("stop-token-ids-negative", TEXT, {"prompt": "x", "stop_token_ids": [-1], "max_tokens": 2}, param="stop_token_ids"),
    Req("seed-too-big", TEXT, {"prompt": "x", "seed": 2**70, "max_tokens": 2}, param="seed"),
    Req("logprobs-too-many", TEXT, {"prompt": "x", "logprobs": 10**6, "max_tokens": 2}, param="logprobs"),
    Req("stream-options-without-stream", TEXT, {"prompt": "x", "stream_options": {"include_usage": True}, "max_tokens": 2},
        param="stream_options"),
    Req("tools-not-function", CHAT, {"messages": HI, "max_tokens": 2, "tools": [{"type": "x"}]}, param="tools.[0]"),
    Req("unknown-key", TEXT, {"prompt": "x", "max_tokens": 2, "temprature": 0.5}, param="temprature"),
    Req("unknown-model", TEXT, {"model": "gpt-9", "prompt": "x", "max_tokens": 2}, param="model", status=404),
    # ---- unusual but reasonable: works
    Req("emoji-and-unicode-chat", CHAT, {"messages": [{"role": "user", "content": "héllo 👋🏽 世界 \u200d"}], "max_tokens": 2}, WORKS),
    Req("surrogate-pair-is-an-emoji", CHAT, b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 2}', WORKS),
    Req("temperature-zero-n-3", TEXT, {"prompt": "x", "temperature": 0, "n": 3, "max_tokens": 2}, WORKS, choices=3),
    Req("max-tokens-1", CHAT, {"messages": HI, "max_tokens": 1}, WORKS),
    Req("null-content-system", CHAT, {"messages": [{"role": "system", "content": None}, *HI], "max_tokens": 2}, WORKS),
    Req("prompt-list-of-two", TEXT, {"prompt": ["a", "b"], "max_tokens": 2, "n": 2}, WORKS, choices=4),
]


@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient

    from posttrain.rollout.serve import ServeConfig, build_worker, make_app

    worker, tok = build_worker(ServeConfig(model="tiny-random", max_num_seqs=8, kv_cache_mb=16, max_model_len=256))
    with TestClient(make_app(worker, tok, "tiny-random", 4), raise_server_exceptions=False) as c:
        yield c
    worker.close()


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_case(case, client):
    if isinstance(case.body, (bytes, str)) and not (isinstance(case.body, str) and case.body == "hello"):
        r = client.post(case.path, content=case.body, headers={"content-type": "application/json"})
    else:
        r = client.post(case.path, json=case.body)
    shown = f"{case.path} {case.body!r:.300}\n-> {r.status_code} {r.text[:600]}"
    if case.expect == WORKS:
        assert r.status_code == 200, shown
        assert len(r.json()["choices"]) == case.choices, shown
        return
    assert r.status_code == case.status, shown
    err = r.json().get("error")
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, shown
    assert err["message"], shown
    if case.param is not None:
        assert err["param"] == case.param or case.param in err["message"], shown
