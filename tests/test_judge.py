"""LLM-as-judge over real HTTP: both orders (ties from disagreement), rubric scores, frozen prompt versions,
retries on malformed replies then reported errors, timeouts, HTTP errors; against a fake judge that
misbehaves on purpose and against `posttrain serve` with the tiny random model."""

import time

import pytest

from posttrain.judge import prompts as judge_prompts
from posttrain.judge.client import Judge, JudgeSettings, parse_pairwise, parse_score, question_text


def judge(fake, **kw):
    return Judge(JudgeSettings(base_url=fake.base_url, **kw))


# ---------------------------------------------------------------- parsing and prompts

@pytest.mark.parametrize("reply,want", [
    ("[[A]]", "A"), ("Because ... so the verdict is [[B]]", "B"), ("[[ b ]]", "B"), ("B", "B"), ("**A**", "A"),
    ("A.", "A"), ("Verdict: A", "A"), ("Response B", "B"),
    ("[[A]] ... on reflection [[B]]", None), ("[[C]]", None), ("Response A is better.", None), ("", None),
    ("A is better than B", None), ("[[A]] and again [[A]]", "A"),
    ("A\n\nThe correct answer is 7.", "A"), ("Response B.\nIt is right.", "B"), ("A: 7\nB: 9", None),
    ("A is the better choice", None), ("The answer is A.", None),
])
def test_parse_pairwise(reply, want):
    assert parse_pairwise(reply) == want


@pytest.mark.parametrize("reply,want", [
    ("Rating: [[7]]", 7.0), ("[[10]]", 10.0), ("[[1]]", 1.0), ("6", 6.0), ("Rating: 8", 8.0), ("8/10", 8.0), ("[[7.5]]", 7.5),
    ("[[0]]", None), ("[[11]]", None), ("[[7]] then [[8]]", None), ("[[seven]]", None), ("It is good.", None),
    ("I give 7 out of 10 points", None), ("7\nIt answers the question.", 7.0), ("7 because it is right", None),
    ("The answer is 7", None),
])
def test_parse_score(reply, want):
    assert parse_score(reply) == want


def test_prompts_are_frozen():
    """Editing a released prompt's text must come with a new version: these hashes are pinned."""
    pinned = {v: judge_prompts.digest(v) for v in judge_prompts.PROMPTS}
    assert pinned == FROZEN, "a judge prompt changed: add a new version instead of editing a released one"


FROZEN = {
    "pairwise-v1": "406bdc19e6afc446304184ac5335eae661bbc1ccd6f0d1c7ba3bc60ff6659a01",
    "pairwise-direct-v1": "1d3e49e68cbce897bff5a87e79f0f537d7c14146c59d45e57acec5919c40b173",
    "score-v1": "5cc50bf974ba6e7d76a2f558c94d0c23d02da1bf63d90bfe926ffe488a613304",
    "score-direct-v1": "19087eb08082b6e005a7aae974f911cd33f34562bd365bf063d838a5a8627f9b",
}


def test_question_text():
    assert question_text("hi") == "hi"
    assert question_text([{"role": "user", "content": "hi"}]) == "hi"
    assert question_text([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]) == "System: be brief\nUser: hi"


def test_settings_refuse_unknown_prompt_versions():
    with pytest.raises(ValueError, match="pairwise prompt is needed"):
        JudgeSettings(pairwise_prompt="score-v1")
    with pytest.raises(ValueError, match="unknown judge prompt"):
        JudgeSettings(score_prompt="score-v9")


# ---------------------------------------------------------------- over HTTP


def test_pairwise_asks_both_orders_and_records_the_version(fake):
    j = judge(fake)
    assert j.connect() == "fake-judge"  # model discovered from /models
    vs = j.compare_many([("q1", "a long answer here", "short"), ("q2", "tiny", "a much longer answer")])
    assert [v.winner for v in vs] == ["a", "b"]
    assert vs[0].orders == ["a", "a"] and vs[1].orders == ["b", "b"]
    assert all(v.version == "pairwise-v1" and v.digest == judge_prompts.digest("pairwise-v1") and v.model == "fake-judge" for v in vs)
    shown = [r["messages"][-1]["content"] for r in fake.requests]
    assert len(shown) == 4
    # each pair was shown once with a first and once with b first
    assert sum("[Response A]\na long answer here" in s for s in shown) == 1
    assert sum("[Response A]\nshort" in s for s in shown) == 1
    assert all(r["temperature"] == 0.0 and r["seed"] == 0 and r["model"] == "fake-judge" for r in fake.requests)
    assert j.stats.calls == 4 and j.stats.questions == 4 and j.stats.failed == 0 and j.stats.prompt_tokens > 0


def test_position_bias_becomes_a_tie(fake):
    fake.verdict = "first"
    vs = judge(fake).compare_many([("q", "one", "two"), ("q", "x" * 50, "y")])
    assert [v.winner for v in vs] == ["tie", "tie"]
    assert all(v.orders == ["a", "b"] and v.preference == 0.5 and v.error is None for v in vs)


def test_malformed_replies_are_retried_at_the_retry_temperature(fake):
    fake.malformed_first = 2
    j = judge(fake, retries=2, retry_temperature=0.9, seed=5)
    v = j.compare_many([("q", "a longer one", "b")])[0]
    assert v.winner == "a" and v.error is None
    assert j.stats.malformed == 4 and j.stats.retries == 4 and j.stats.calls == 6 and j.stats.failed == 0
    per_question = {}
    for r in fake.requests:
        per_question.setdefault(r["messages"][-1]["content"], []).append((r["temperature"], r["seed"]))
    assert all(calls == [(0.0, 5), (0.9, 6), (0.9, 7)] for calls in per_question.values())


def test_malformed_after_all_retries_is_an_error_not_a_verdict(fake):
    fake.malformed_first = 10
    j = judge(fake, retries=1)
    v = j.compare_many([("q", "aa", "b")])[0]
    assert v.winner is None and v.preference is None
    assert "malformed" in v.error and "hard to say" in v.error and "after 2 attempts" in v.error
    assert j.stats.failed == 2 and j.stats.calls == 4
    s = j.score_many([("q", "an answer")])[0]
    assert s.score is None and "malformed" in s.error


def test_timeouts_are_retried_then_reported(fake):
    fake.delay_s = 1.5
    j = judge(fake, timeout_s=0.2, retries=1, concurrency=2)
    t = time.perf_counter()
    v = j.compare_many([("q", "aa", "b")])[0]
    took = time.perf_counter() - t
    assert v.winner is None and "timeout" in v.error
    assert j.stats.timeouts == 4 and j.stats.failed == 2
    assert took < 1.4  # two attempts of 0.2 s plus a 0.1 s back-off, never the server's 1.5 s


def test_server_errors_are_retried_client_errors_are_not(fake):
    fake.status_first, fake.status = 1, 503
    j = judge(fake, retries=1)
    assert j.compare_many([("q", "aa", "b")])[0].winner == "a"
    assert j.stats.http_errors == 2 and j.stats.retries == 2
    fake.seen.clear()
    fake.status_first, fake.status = 5, 400
    j = judge(fake, retries=3)
    v = j.score_many([("q", "answer")])[0]
    assert v.score is None and "http 400" in v.error and "after 1 attempt" in v.error
    assert j.stats.calls == 1


def test_rubric_scores(fake):
    j = judge(fake, score_prompt="score-direct-v1")
    vs = j.score_many([("q", "x" * 5), ("q", "x" * 45), ("q", "x" * 500)], rubric="Be concise and kind.")
    assert [v.score for v in vs] == [1.0, 5.0, 10.0]
    assert all(v.version == "score-direct-v1" for v in vs)
    assert all("Be concise and kind." in r["messages"][-1]["content"] for r in fake.requests)
    j.score_many([("q", "y")])
    assert judge_prompts.DEFAULT_RUBRIC in fake.requests[-1]["messages"][-1]["content"]


def test_unreachable_endpoint_is_a_user_error():
    from posttrain.errors import UserError

    with pytest.raises(UserError, match="does not answer"):
        Judge(JudgeSettings(base_url="http://127.0.0.1:9/v1", timeout_s=2)).connect()


def test_against_posttrain_serve_with_a_tiny_random_model():
    """A random model never writes a verdict: every question is retried, then reported as malformed."""
    from posttrain.rollout.serve import ServeConfig, ServerThread, build_worker, make_app

    worker, tok = build_worker(ServeConfig(model="tiny-random", max_num_seqs=8, kv_cache_mb=64, max_model_len=1024))
    try:
        with ServerThread(make_app(worker, tok, "tiny-random", 16)) as srv:
            j = Judge(JudgeSettings(base_url=srv.base_url, max_tokens=8, retries=1, concurrency=4))
            vs = j.compare_many([("What is 2 + 2?", "4", "5"), ("Name a colour.", "red", "blue")])
            assert all(v.winner is None and "malformed" in v.error for v in vs)
            assert j.stats.calls == 8 and j.stats.malformed == 8 and j.stats.completion_tokens > 0
            assert worker.peak_jobs >= 2  # concurrent judge calls decoded together
    finally:
        worker.close()
