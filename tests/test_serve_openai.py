"""`posttrain serve` through the `openai` SDK: streaming (chat and completions, include_usage), logprobs in both
shapes, echo with the prompt's own log-probs, token-id prompts, models.retrieve, tools, top_k, and errors in
OpenAI's shape (what the SDK raises, with type / param / code)."""

import json
import math

import httpx
import pytest

from posttrain.rollout.serve import EngineWorker, ServeConfig, ServerThread, build_worker, make_app
from test_serve import ExplodingEngine

openai = pytest.importorskip("openai", reason="the openai SDK is not installed: pip install -e '.[dev]'")

TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def served():
    worker, tok = build_worker(ServeConfig(model="tiny-random", max_num_seqs=8, kv_cache_mb=32, max_model_len=256))
    with ServerThread(make_app(worker, tok, "tiny-random", 12)) as srv:
        yield openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=60), srv.base_url, tok
    worker.close()


def close(a, b, tol=1e-5):
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=0, abs_tol=tol) for x, y in zip(a, b))


def hi(content="Say hi"):
    return [{"role": "user", "content": content}]


def test_streamed_chat_and_completions_equal_the_whole_reply(served):
    client, _, _ = served
    whole = client.chat.completions.create(model="tiny-random", messages=hi(), max_tokens=10, seed=5, n=2, logprobs=True, top_logprobs=2)
    chunks = list(client.chat.completions.create(model="tiny-random", messages=hi(), max_tokens=10, seed=5, n=2, stream=True,
                                                 logprobs=True, top_logprobs=2, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    for j in range(2):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == j]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == whole.choices[j].message.content
        assert [c.finish_reason for c in mine if c.finish_reason] == [whole.choices[j].finish_reason]
        streamed_lp = [t for c in mine if c.logprobs for t in c.logprobs.content]
        # the same tokens; values up to float noise (the second call's prompt comes from the prefix cache)
        assert [t.token for t in streamed_lp] == [t.token for t in whole.choices[j].logprobs.content]
        assert close([t.logprob for t in streamed_lp], [t.logprob for t in whole.choices[j].logprobs.content])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])

    text = client.completions.create(model="tiny-random", prompt=["one", "two"], max_tokens=8, seed=1, logprobs=1)
    stream = list(client.completions.create(model="tiny-random", prompt=["one", "two"], max_tokens=8, seed=1, logprobs=1, stream=True))
    for choice in text.choices:
        mine = [ch.choices[0] for ch in stream if ch.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert close([t for c in mine if c.logprobs for t in c.logprobs.token_logprobs], choice.logprobs.token_logprobs)
        assert [t for c in mine if c.logprobs for t in c.logprobs.text_offset] == choice.logprobs.text_offset


def test_stream_holds_back_a_stop_string_until_it_is_resolved(served):
    client, _, _ = served
    full = client.completions.create(model="tiny-random", prompt="Count", max_tokens=12, temperature=0).choices[0].text
    words = full.split()
    if len(words) < 3:
        pytest.skip("the random model wrote too few words")
    stop = " " + words[2]
    cut = client.completions.create(model="tiny-random", prompt="Count", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.find(stop)] and cut.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="tiny-random", prompt="Count", max_tokens=12, temperature=0, stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut.choices[0].text
    kept = client.completions.create(model="tiny-random", prompt="Count", max_tokens=12, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == full[:full.find(stop) + len(stop)]


def test_completion_logprobs_are_the_models_own(served):
    """Sampled tokens' log-probs (the engine's logits, temperature 1) equal the prompt log-probs of the same text scored
    with echo (one forward of prompt + completion); the top alternatives are sorted and contain the greedy token."""
    client, _, tok = served
    prompt = tok("The quick brown fox")["input_ids"]
    r = client.completions.create(model="tiny-random", prompt=prompt, max_tokens=6, temperature=0.8, seed=3, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == r.usage.completion_tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and top[token] == value  # the top 3 and the sampled token
        assert max(top.values()) >= value
    completion = tok(r.choices[0].text, add_special_tokens=False)["input_ids"]
    scored = client.completions.create(model="tiny-random", prompt=prompt + completion, max_tokens=0, echo=True, logprobs=0)
    if len(completion) == len(lp.tokens):  # the text re-tokenizes to the same tokens
        want = scored.choices[0].logprobs.token_logprobs[len(prompt):]
        assert all(math.isclose(a, b, abs_tol=2e-4) for a, b in zip(lp.token_logprobs, want)), (lp.token_logprobs, want)

    greedy = client.completions.create(model="tiny-random", prompt=prompt, max_tokens=4, temperature=0, logprobs=1)
    g = greedy.choices[0].logprobs
    assert all(v == max(top.values()) for v, top in zip(g.token_logprobs, g.top_logprobs))  # lm-eval's is_greedy test


def test_echo_scores_a_token_id_prompt_as_lm_eval_asks(served):
    """echo=True, max_tokens=0, logprobs=1 on token ids: the prompt's per-token log-probs, the first null; they are the
    model's forward exactly (log_softmax of its logits). lm-eval's own request (max_tokens=1) echoes prompt + 1 token."""
    import torch

    from posttrain.models.loading import load_model

    client, _, tok = served
    prompts = [tok("Question: what is 2 + 2?\nAnswer: 4")["input_ids"], tok("Hello there")["input_ids"]]
    r = client.completions.create(model="tiny-random", prompt=prompts, max_tokens=0, echo=True, logprobs=1)
    model = load_model("tiny-random").eval()
    for ids, choice in zip(prompts, r.choices):
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
        assert choice.text == tok.decode(ids) and choice.finish_reason == "length"
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits[0], -1)
        assert lp.token_logprobs[1:] == [ref[t - 1, ids[t]].item() for t in range(1, len(ids))]
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == sum(map(len, prompts))
    lm_eval_like = client.completions.create(model="tiny-random", prompt=[prompts[0]], max_tokens=1, echo=True, logprobs=1,
                                             temperature=0, seed=1234)
    lp = lm_eval_like.choices[0].logprobs
    assert len(lp.token_logprobs) == len(prompts[0]) + 1 and lp.token_logprobs[:-1] == r.choices[0].logprobs.token_logprobs
    streamed = list(client.completions.create(model="tiny-random", prompt=prompts[1], max_tokens=0, echo=True, logprobs=1, stream=True))
    assert [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs] == \
        r.choices[1].logprobs.token_logprobs


def test_chat_logprobs_shape(served):
    client, _, _ = served
    r = client.chat.completions.create(model="tiny-random", messages=hi(), max_tokens=5, logprobs=True, top_logprobs=3, temperature=0)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == t.logprob  # greedy: the token is the top one
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token
    plain = client.chat.completions.create(model="tiny-random", messages=hi(), max_tokens=5, logprobs=True, temperature=0)
    assert all(t.top_logprobs == [] for t in plain.choices[0].logprobs.content)
    assert client.chat.completions.create(model="tiny-random", messages=hi(), max_tokens=2).choices[0].logprobs is None


def test_models_top_k_and_noop_defaults(served):
    client, url, _ = served
    assert client.models.retrieve("tiny-random").id == "tiny-random"
    assert [m.id for m in client.models.list()] == ["tiny-random"]
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-9")
    assert e.value.code == "model_not_found" and "tiny-random" in e.value.message
    greedy = client.completions.create(model="tiny-random", prompt="abc", max_tokens=6, temperature=0).choices[0].text
    top1 = client.completions.create(model="tiny-random", prompt="abc", max_tokens=6, temperature=1, seed=9, extra_body={"top_k": 1})
    assert top1.choices[0].text == greedy  # top_k=1 keeps the argmax only
    r = client.chat.completions.create(model="tiny-random", messages=hi(), max_tokens=3, frequency_penalty=0, presence_penalty=0,
                                       logit_bias={}, user="me", n=1, top_p=1, stream=False, response_format={"type": "text"},
                                       parallel_tool_calls=True, metadata={"k": "v"}, store=False, service_tier="auto")
    assert r.choices[0].finish_reason in ("stop", "length")
    r = client.completions.create(model="tiny-random", prompt="x", max_tokens=2, best_of=1, frequency_penalty=0, logit_bias={"5": 0},
                                  suffix=None, user="me", extra_body={"repetition_penalty": 1.0, "min_p": 0, "top_k": -1})
    assert len(r.choices) == 1


def test_errors_have_openais_shape(served):
    client, url, _ = served
    cases = [  # (call kwargs, status, param, code)
        (dict(frequency_penalty=0.5), 400, "frequency_penalty", "unsupported_value"),
        (dict(logit_bias={"5": 3.0}), 400, "logit_bias", "unsupported_value"),
        (dict(best_of=3), 400, "best_of", "unsupported_value"),
        (dict(max_tokens=10**9), 400, "max_tokens", "context_length_exceeded"),
        (dict(prompt="word " * 400), 400, "prompt", "context_length_exceeded"),
        (dict(prompt=[[1, 2, 10**7]]), 400, "prompt", None),
        (dict(extra_body={"foo": 1}), 400, "foo", None),
        (dict(n="many"), 400, "n", None),
        (dict(logprobs=99), 400, "logprobs", None),
    ]
    for kw, status, param, code in cases:
        kw = {"prompt": "x", "max_tokens": 2, **kw}
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="tiny-random", **kw)
        err = e.value
        assert (err.status_code, err.param, err.code, err.type) == (status, param, code, "invalid_request_error"), (kw, err.body)
        assert isinstance(err.message, str) and err.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-random", messages=hi(), max_tokens=2, top_logprobs=2)
    assert e.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:,"}}]}], max_tokens=2)
    assert "text only" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x")
    for method, path, body in (("POST", "/nope", None), ("GET", "/chat/completions", None), ("POST", "/completions", b"{not json")):
        r = httpx.request(method, url + path, content=body, headers={"content-type": "application/json"})
        assert r.status_code in (400, 404, 405) and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    r = httpx.post(url + "/completions", json=[1, 2])
    assert r.status_code == 400 and "error" in r.json()  # never FastAPI's 422 {"detail": ...}


def test_tools_are_rendered_through_the_chat_template(tmp_path):
    template = tmp_path / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    worker, tok = build_worker(ServeConfig(model="tiny-random", chat_template=str(template), max_num_seqs=4, kv_cache_mb=16,
                                           max_model_len=512))
    try:
        with ServerThread(make_app(worker, tok, "tiny-random", 4)) as srv:
            client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=60)
            plain = client.chat.completions.create(model="tiny-random", messages=hi("Weather in Paris?"), max_tokens=2)
            tooled = client.chat.completions.create(model="tiny-random", messages=hi("Weather in Paris?"), max_tokens=2, tools=[WEATHER])
            assert tooled.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # the tool's schema is in the prompt
            none = client.chat.completions.create(model="tiny-random", messages=hi("Weather in Paris?"), max_tokens=2, tools=[WEATHER],
                                                  tool_choice="none")
            assert none.usage.prompt_tokens == plain.usage.prompt_tokens
            history = hi("Weather in Paris?") + [
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
            r = client.chat.completions.create(model="tiny-random", messages=history, max_tokens=2, tools=[WEATHER])
            assert r.choices[0].message.role == "assistant"
            for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
                with pytest.raises(openai.BadRequestError) as e:
                    client.chat.completions.create(model="tiny-random", messages=hi(), max_tokens=2, tools=[WEATHER], tool_choice=choice)
                assert e.value.param == "tool_choice" and "constrained decoding" in e.value.message
    finally:
        worker.close()


def test_tools_refused_by_a_template_that_ignores_them(served):
    client, _, _ = served  # the tiny tokenizer's template has no `tools`
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-random", messages=hi(), max_tokens=2, tools=[WEATHER])
    assert e.value.param == "tools" and "does not render tools" in e.value.message


class ScriptedEngine:
    """Stands in for the engine: every request is answered at once with the tokens of `text`."""

    def __init__(self, tok, text):
        self.ids, self.tok = tok(text, add_special_tokens=False)["input_ids"], tok
        self.max_model_len, self.vocab_size = 512, len(tok)

    def has_work(self):
        return False

    def add_request(self, request, index=0):
        from types import SimpleNamespace

        from posttrain.rollout.types import Completion, RequestOutput

        out = RequestOutput(index, request.prompt_token_ids)
        out.samples = [Completion(j, list(self.ids), [0.0] * len(self.ids), "stop", self.tok.decode(self.ids))
                       for j in range(request.params.n)]
        return SimpleNamespace(remaining=0, output=out, request=request)


def test_hermes_tool_calls_are_parsed(tmp_path):
    from posttrain.models.loading import load_tokenizer
    from posttrain.rollout.openai_protocol import parse_tool_calls

    content, calls = parse_tool_calls('Let me look.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>')
    assert content == "Let me look." and calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert parse_tool_calls("<tool_call>{not json}</tool_call>")[1] == []  # no half-parsed calls

    tok = load_tokenizer("tiny-random")
    tok.chat_template = TOOLS_TEMPLATE
    worker = EngineWorker(ScriptedEngine(tok, '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'))
    try:
        with ServerThread(make_app(worker, tok, "scripted", 4)) as srv:
            client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=60)
            r = client.chat.completions.create(model="scripted", messages=hi(), tools=[WEATHER])
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            call = choice.message.tool_calls[0]
            assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
            chunks = list(client.chat.completions.create(model="scripted", messages=hi(), tools=[WEATHER], stream=True))
            deltas = [c.choices[0].delta for c in chunks]
            assert deltas[0].role == "assistant" and deltas[1].tool_calls[0].function.name == "get_weather"
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
            text = client.chat.completions.create(model="scripted", messages=hi())  # no tools: the text as it is
            assert text.choices[0].message.content.startswith("<tool_call>") and text.choices[0].finish_reason == "stop"
    finally:
        worker.close()


def test_a_failing_engine_ends_the_stream_with_an_error(served):
    w = EngineWorker(ExplodingEngine())
    try:
        with ServerThread(make_app(w, served[2], "x")) as srv:
            client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=30)
            with pytest.raises(openai.APIError, match="boom"):
                list(client.completions.create(model="x", prompt="hi", max_tokens=3, stream=True))
    finally:
        w.close()


def test_hf_backend_streams_and_scores_too():
    """backend=hf runs under StepAdapter (one blocking call): the stream arrives at the end, logprobs and echo the same."""
    worker, tok = build_worker(ServeConfig(model="tiny-random", backend="hf", max_model_len=256))
    try:
        with ServerThread(make_app(worker, tok, "tiny-random", 6)) as srv:
            client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=60)
            whole = client.completions.create(model="tiny-random", prompt="Hello", max_tokens=5, temperature=0, logprobs=2)
            chunks = list(client.completions.create(model="tiny-random", prompt="Hello", max_tokens=5, temperature=0, logprobs=2,
                                                    stream=True))
            assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
            lp = whole.choices[0].logprobs
            assert all(v == max(top.values()) for v, top in zip(lp.token_logprobs, lp.top_logprobs))
            ids = tok("Hello there friend")["input_ids"]
            echo = client.completions.create(model="tiny-random", prompt=ids, max_tokens=0, echo=True, logprobs=1)
            assert echo.choices[0].logprobs.token_logprobs[0] is None and len(echo.choices[0].logprobs.tokens) == len(ids)
    finally:
        worker.close()
