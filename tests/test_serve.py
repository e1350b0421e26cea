"""`posttrain serve`: the OpenAI-compatible server over the built-in engine, over real HTTP (the CLI in a
subprocess, and the app in a thread for the batching checks)."""

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from posttrain.rollout.serve import ServeConfig, ServerThread, build_worker, make_app


@pytest.fixture(scope="module")
def served():
    worker, tok = build_worker(ServeConfig(model="tiny-random", max_num_seqs=16, kv_cache_mb=64, max_model_len=1024))
    with ServerThread(make_app(worker, tok, "tiny-random", 12)) as srv:
        yield srv.base_url, worker, tok
    worker.close()


def chat(url, content, **kw):
    r = httpx.post(url + "/chat/completions", json={"messages": [{"role": "user", "content": content}], **kw}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_cli_serves_chat_and_text_completions(tmp_path):
    """`posttrain serve model=tiny-random port=0` prints its URL and answers the OpenAI API."""
    env = dict(os.environ, POSTTRAIN_NO_PROGRESS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli", "serve", "model=tiny-random", "port=0", "max_tokens=6",
                             "kv_cache_mb=64", "max_num_seqs=8"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "posttrain serve: tiny-random at http://127.0.0.1:" in line, line
        url = line.split(" at ")[1].split()[0]
        assert httpx.get(url + "/models").json()["data"][0]["id"] == "tiny-random"
        out = chat(url, "Say hi", n=3, seed=7)
        assert out["object"] == "chat.completion" and [c["index"] for c in out["choices"]] == [0, 1, 2]
        assert all(c["message"]["role"] == "assistant" and c["finish_reason"] in ("stop", "length") for c in out["choices"])
        assert 0 < out["usage"]["completion_tokens"] <= 3 * 6 and out["usage"]["prompt_tokens"] > 0
        r = httpx.post(url + "/completions", json={"prompt": ["one", "two"], "n": 2, "max_tokens": 4, "seed": 1}, timeout=60).json()
        assert r["object"] == "text_completion" and [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
        bad = httpx.post(url + "/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "top_p": 0}, timeout=60)
        assert bad.status_code == 400 and "top_p" in bad.json()["error"]["message"]
        streamed = httpx.post(url + "/completions", json={"prompt": "x", "stream": True, "max_tokens": 3}, timeout=60)
        assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
        lp = httpx.post(url + "/completions", json={"prompt": "x", "logprobs": 1, "max_tokens": 3}, timeout=60).json()
        assert len(lp["choices"][0]["logprobs"]["token_logprobs"]) == 3
        refused = httpx.post(url + "/completions", json={"prompt": "x", "presence_penalty": 1.0})  # not silently ignored
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "presence_penalty"
        wrong = httpx.post(url + "/completions", json={"prompt": "x", "model": "gpt-9"})
        assert wrong.status_code == 404 and "tiny-random" in wrong.json()["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_seeded_samples_equal_the_engine_and_do_not_depend_on_batching(served):
    """Concurrent calls decode together (continuous batching across HTTP calls); with a seed each call gets
    exactly the text the engine gives that request alone: sample j uses the random stream (seed, j)."""
    from posttrain.data.templates import render_prompt
    from posttrain.models.loading import load_model
    from posttrain.rollout.engine import Engine, EngineConfig
    from posttrain.rollout.types import Request, SamplingParams

    url, worker, tok = served
    prompts = [f"Tell me about the number {i}." for i in range(6)]
    call = lambda i: [c["message"]["content"] for c in chat(url, prompts[i], n=2, seed=100 + i, max_tokens=10)["choices"]]
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(call, range(6)))
    alone = [call(i) for i in range(6)]
    assert together == alone
    engine = Engine(load_model("tiny-random").eval(), tok, EngineConfig(max_num_seqs=4, kv_cache_mb=64, max_model_len=1024))
    direct = engine.generate([Request(render_prompt(tok, [{"role": "user", "content": p}]),
                                      SamplingParams(n=2, max_new_tokens=10, seed=100 + i)) for i, p in enumerate(prompts)])
    assert [[s.text for s in o.samples] for o in direct] == alone


class SlowEngine:
    """Stands in for the engine: each request needs 3 steps of 50 ms; records the requests in each step."""

    def __init__(self):
        self.active, self.batch_sizes = [], []

    def has_work(self):
        return bool(self.active)

    def add_request(self, request, index=0):
        from types import SimpleNamespace

        from posttrain.rollout.types import RequestOutput

        st = SimpleNamespace(remaining=1, steps=3, output=RequestOutput(index, request.prompt_token_ids))
        self.active.append(st)
        return st

    def step(self):
        time.sleep(0.05)
        self.batch_sizes.append(len(self.active))
        for st in list(self.active):
            st.steps -= 1
            if st.steps == 0:
                st.remaining = 0
                self.active.remove(st)


def test_calls_arriving_during_a_batch_join_it():
    """A request submitted while another decodes joins the running batch at the next step (no waiting
    for the first to finish): continuous batching across HTTP calls."""
    from posttrain.rollout.serve import EngineWorker
    from posttrain.rollout.types import Request

    engine = SlowEngine()
    w = EngineWorker(engine)
    first = w.submit([Request([1, 2])])
    time.sleep(0.01)
    second = w.submit([Request([3]), Request([4])])
    assert [o.prompt_token_ids for o in second.result(timeout=10)] == [[3], [4]]
    assert first.result(timeout=10)[0].prompt_token_ids == [1, 2]
    assert max(engine.batch_sizes) == 3 and w.peak_jobs == 2
    assert len(engine.batch_sizes) <= 5  # 3 steps each, overlapped; serialized calls would take 6
    w.close()


def test_limits_stops_and_errors(served):
    url, worker, tok = served
    out = chat(url, "Count", max_tokens=5, temperature=0)
    c = out["choices"][0]
    assert c["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 5
    full = c["message"]["content"]
    stop = full.strip().split()[0] if full.strip() else None
    if stop:  # the text ends before the stop string, as OpenAI's API does
        cut = chat(url, "Count", max_tokens=5, temperature=0, stop=stop)["choices"][0]
        assert cut["message"]["content"] == full[:full.find(stop)] and cut["finish_reason"] == "stop"
    assert chat(url, "Count")["usage"]["completion_tokens"] <= 12  # the server's default max_tokens
    long = httpx.post(url + "/completions", json={"prompt": "word " * 1100, "max_tokens": 4}, timeout=60)
    assert long.status_code == 400 and "context" in long.json()["error"]["message"]
    assert httpx.post(url + "/chat/completions", json={"messages": []}).status_code == 400
    health = httpx.get(url[:-3] + "/health").json()
    assert health["status"] == "ok" and health["requests_served"] > 0


class ExplodingEngine:
    """An engine whose step raises: what a crash inside generation looks like to the server."""

    @staticmethod
    def has_work():
        return True

    def add_request(self, request, index=0):
        class S:
            remaining = 1
        return S()

    def step(self):
        raise RuntimeError("boom")


def test_a_broken_engine_fails_its_callers_not_the_server(served):
    """An exception inside the engine reaches every waiting caller as a 503; later calls are refused."""
    from posttrain.rollout.serve import EngineWorker

    w = EngineWorker(ExplodingEngine())
    app = make_app(w, served[2], "x")
    with ServerThread(app) as srv:
        r = httpx.post(srv.base_url + "/completions", json={"prompt": "hi"}, timeout=30)
        assert r.status_code == 503 and "boom" in r.json()["error"]["message"]
        time.sleep(0.05)
        assert httpx.post(srv.base_url + "/completions", json={"prompt": "hi"}, timeout=30).status_code == 503
    w.close()
