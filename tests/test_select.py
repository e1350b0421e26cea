"""Test-time selection (rollout/select.py, eval/selection.py): best_of_n and majority on fixed samples, the
tie rules, eval's bon@k / maj@k and their cost, generate and serve with select=, and the refusals."""

import json

import httpx
import pytest

from conftest import write_jsonl
from posttrain.data.formats import Row
from posttrain.errors import UserError
from posttrain.eval.prompts import Item
from posttrain.eval.runner import ItemResult, Sample
from posttrain.eval.selection import selection_values
from posttrain.rollout.select import Selector, best_index, check_select, majority_index


def test_best_index_highest_reward_first_on_ties_none_never_wins():
    assert best_index([0.2, 0.9, 0.9, None]) == 1  # tie 0.9 at 1 and 2: the lowest index
    assert best_index([None, -3.0, None]) == 1  # a reward beats no reward, however low
    assert best_index([None, None]) == 0  # nothing scored: the first sample
    assert best_index([-1.0]) == 0


def test_majority_index_most_votes_first_class_on_ties_abstentions():
    assert majority_index([None, 1, 1, 0]) == (1, 2)  # class 1 has 2 votes; its first sample is 1
    assert majority_index([0, 1, 1, None, 0, 2]) == (0, 2)  # 0 and 1 tie at 2 votes: class 0 appears first
    assert majority_index([2, 1, 1, 2]) == (0, 2)  # tie: class 2 is seen first (sample 0)
    assert majority_index([None, None]) == (0, 0)


def test_majority_votes_on_equivalent_answers():
    """'1/2' and '0.5' are one answer (the verifier's equivalence): 2 votes, against 2 for '7' seen earlier."""
    sel = Selector("majority", "math", {"math": {"mode": "last_number"}})
    texts = ["I think 5", "7", "so 7", "1/2", "0.5", "0.50"]
    [ch] = sel.choose([("What is 3 + 4?", {}, texts, [[]] * 6)])
    assert ch.answers == ["5", "7", "7", "1/2", "0.5", "0.50"]
    assert ch.classes == [0, 1, 1, 2, 2, 2] and ch.index == 3 and ch.votes == 3
    assert not sel.oracle and "majority" in sel.describe()


def test_best_of_n_by_the_verifier_is_an_oracle():
    sel = Selector("best_of_n", "math", {"math": {"mode": "last_number"}})
    chs = sel.choose([("What is 2 + 3?", {"answer": "5"}, ["4", "5", "5"], [[]] * 3),
                      ("What is 1 + 1?", {"answer": "2"}, ["3", "4"], [[]] * 2)])
    assert [c.rewards for c in chs] == [[0.0, 1.0, 1.0], [0.0, 0.0]] and [c.index for c in chs] == [1, 0]
    assert sel.oracle and "ORACLE" in sel.describe()
    with pytest.raises(UserError, match=r"row 2: field 'answer' missing"):
        sel.check_rows([{"answer": "1"}, {}], "p.jsonl")


def test_best_of_n_by_a_file_reward_sees_no_reference(tmp_path):
    f = tmp_path / "longest.py"
    f.write_text("def longest(prompts, completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    sel = Selector("best_of_n", f"{f}:longest")
    [ch] = sel.choose([("q", {}, ["ab", "abcd", "abcd", "a"], [[]] * 4)])
    assert ch.index == 1 and ch.rewards == [2.0, 4.0, 4.0, 1.0] and not sel.oracle


@pytest.mark.parametrize("args,match", [
    (("best_of_m", 4, "math"), r"select='best_of_m' is not a selection method; did you mean 'best_of_n'"),
    (("best_of_n", 4, ""), r"select=best_of_n needs reward=: the reward that ranks"),
    (("majority", 4, ""), r"select=majority needs reward=: the math verifier"),
    (("majority", 0, "math"), r"needs n >= 1"),
])
def test_misuse_is_refused(args, match):
    with pytest.raises(UserError, match=match):
        check_select(*args)


def test_majority_without_math_and_missing_reward_model_are_refused(tmp_path):
    with pytest.raises(UserError, match="must contain math"):
        Selector("majority", "format")
    with pytest.raises(UserError, match="reward model folder not found"):
        Selector("best_of_n", f"rm:{tmp_path / 'nope'}")


def _result(correct, classes, scores=None, tokens=None):
    samples = [Sample(str(i), (tokens or [3] * len(correct))[i], "stop", score=(scores or [float(c) for c in correct])[i],
                      correct=bool(c)) for i, c in enumerate(correct)]
    return ItemResult(Item(0, "x", Row({"prompt": "q"}, "t", 1), None, "q", [1]), samples, classes)


def test_eval_selection_on_the_first_k_samples():
    """bon@k (by the verifier) = any of the first k right; maj@k = the kept class's verdict; tokens = first k samples."""
    a = _result([0, 1, 0, 0], [0, 1, 0, 0], tokens=[2, 3, 4, 5])  # majority class 0 (wrong); sample 1 right
    b = _result([0, 0, 1, 1], [0, 1, 2, 2])  # k=2: tie 0/1 -> class 0 (wrong); k=4: class 2 (right)
    vals, recs = selection_values("best_of_n", [a, b], [1, 2, 4])
    assert vals == [{"bon@1": 0.0, "bon@2": 1.0, "bon@4": 1.0}, {"bon@1": 0.0, "bon@2": 0.0, "bon@4": 1.0}]
    assert recs[0]["tokens"] == {"1": 2, "2": 5, "4": 14} and recs[0]["selected"] == {"1": 0, "2": 1, "4": 1}
    vals, recs = selection_values("majority", [a, b], [1, 2, 4])
    assert vals == [{"maj@1": 0.0, "maj@2": 0.0, "maj@4": 0.0}, {"maj@1": 0.0, "maj@2": 0.0, "maj@4": 1.0}]
    assert recs[1]["selected"] == {"1": 0, "2": 0, "4": 2}
    vals, _ = selection_values("best_of_n", [a], [4], rewards=[[0.1, 0.0, 0.9, 0.2]])  # another reward ranks: sample 2 (wrong)
    assert vals == [{"bon@4": 0.0}]


def test_eval_select_reports_accuracy_interval_and_cost(tmp_path, capsys):
    from posttrain.eval.cli import main as eval_main

    out = tmp_path / "ev"
    assert eval_main(["model=tiny-random", "data=single_digit_add:all", "max_items=4", "n=3", "k=1,3", "max_new_tokens=4",
                      "select=majority", "reward_args={math: {mode: last_number}}", f"output_dir={out}"]) == 0
    doc = json.loads((out / "results.json").read_text())
    sel = doc["selection"]
    assert sel["method"] == "majority" and not sel["oracle"] and [r["k"] for r in sel["per_k"]] == [1, 3]
    per_item = [sum(s["tokens"] for s in it["samples"]) for it in doc["items"]]
    assert sel["per_k"][1]["generated_tokens"] == sum(per_item) == doc["timing"]["generated_tokens"]  # all n samples count
    assert sel["per_k"][0]["generated_tokens"] == sum(it["samples"][0]["tokens"] for it in doc["items"])
    m = doc["metrics"]["maj@3"]
    assert m["value"] == 0.0 and m["low"] == 0.0 and "wilson over 4 problems" in m["interval"]
    assert "maj@3" in capsys.readouterr().out
    with pytest.raises(UserError, match="has no math verifier"):
        eval_main(["model=tiny-random", "data=humaneval_mini:all", "max_items=1", "select=majority", f"output_dir={out}"])


def test_eval_select_keys_are_checked():
    from posttrain.config import ConfigError, parse_args
    from posttrain.eval.config import EvalConfig

    with pytest.raises(ConfigError, match="not a selection method"):
        parse_args(EvalConfig, ["select=vote"])
    with pytest.raises(ConfigError, match="select=best_of_n only"):
        parse_args(EvalConfig, ["select=majority", "select_reward=rm:x"])


def test_generate_select_writes_one_kept_sample_per_prompt(tmp_path):
    from posttrain.cli import main

    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(3)])
    every, kept = tmp_path / "all.jsonl", tmp_path / "kept.jsonl"
    common = ["generate", "model=tiny-random", f"data={data}", "n=4", "max_new_tokens=5", "seed=3"]
    assert main([*common, f"output={every}"]) == 0
    (tmp_path / "long.py").write_text("def longest(prompts, completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    assert main([*common, f"output={kept}", "select=best_of_n", f"reward={tmp_path / 'long.py'}:longest"]) == 0
    samples = [json.loads(x) for x in every.read_text().splitlines()]
    rows = [json.loads(x) for x in kept.read_text().splitlines()]
    assert len(rows) == 3
    for r in rows:
        mine = [s for s in samples if s["prompt_index"] == r["prompt_index"]]
        lengths = [float(len(s["text"])) for s in mine]
        assert r["selection"]["rewards"] == lengths and r["sample_index"] == lengths.index(max(lengths))
        assert r["text"] == mine[r["sample_index"]]["text"] and r["answer"] == mine[0]["answer"]
        assert r["generated_tokens"] == sum(len(s["token_ids"]) for s in mine)


def test_generate_select_refusals(tmp_path):
    from posttrain.rollout.cli import main

    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    with pytest.raises(UserError, match="needs reward="):
        main(["model=tiny-random", f"data={data}", "n=2", "select=best_of_n"])
    with pytest.raises(UserError, match="row 1: field 'answer' missing"):
        main(["model=tiny-random", f"data={data}", "n=2", "select=best_of_n", "reward=math"])
    with pytest.raises(UserError, match="reward model folder not found"):
        main(["model=tiny-random", f"data={data}", "n=2", "select=best_of_n", f"reward=rm:{tmp_path / 'missing'}"])


def test_serve_select_keeps_the_best_of_n_samples(tmp_path):
    """The server draws n·N samples per call and returns, per choice, the one the reward ranks highest among its N;
    usage counts every sample drawn."""
    from posttrain.rollout.serve import ServeConfig, ServerThread, build_selector, build_worker, make_app

    f = tmp_path / "longest.py"
    f.write_text("def longest(prompts, completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    cfg = ServeConfig(model="tiny-random", max_num_seqs=16, kv_cache_mb=64, max_model_len=512, select="best_of_n", n=4,
                      reward=f"{f}:longest")
    worker, tok = build_worker(cfg)
    try:
        with ServerThread(make_app(worker, tok, "tiny-random", 8)) as plain, \
                ServerThread(make_app(worker, tok, "tiny-random", 8, build_selector(cfg), 4)) as sel:
            body = {"messages": [{"role": "user", "content": "Say something"}], "seed": 5, "max_tokens": 8}
            every = httpx.post(plain.base_url + "/chat/completions", json={**body, "n": 8}, timeout=60).json()
            kept = httpx.post(sel.base_url + "/chat/completions", json={**body, "n": 2}, timeout=60).json()
            texts = [c["message"]["content"] for c in every["choices"]]
            for j, c in enumerate(kept["choices"]):
                group = texts[4 * j:4 * j + 4]
                assert c["index"] == j and c["message"]["content"] == max(group, key=len)
                assert c["selection"]["rewards"] == [float(len(t)) for t in group]
            assert kept["usage"]["completion_tokens"] == every["usage"]["completion_tokens"]
            r = httpx.post(sel.base_url + "/completions", json={"prompt": "one", "n": 1, "max_tokens": 6, "seed": 2}, timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["selection"]["n"] == 4
            streamed = httpx.post(sel.base_url + "/chat/completions", json={**body, "stream": True}, timeout=60)
            assert streamed.status_code == 400 and "stream=false" in streamed.json()["error"]["message"]
    finally:
        worker.close()
    with pytest.raises(UserError, match="a request does not carry"):
        build_selector(ServeConfig(select="best_of_n", n=4, reward="math"))
    with pytest.raises(UserError, match="needs reward="):
        build_selector(ServeConfig(select="majority", n=4))


def test_eval_best_of_n_by_a_reward_model_is_not_an_oracle(tmp_path):
    """select_reward=rm:PATH ranks by a (random, untrained) reward model; the verifier still judges the kept sample."""
    from transformers import AutoModelForSequenceClassification

    from posttrain.eval.cli import main as eval_main
    from posttrain.models.loading import load_model, load_tokenizer
    from posttrain.rewards.reward_model import RewardModelScorer

    rm, lm = tmp_path / "rm", tmp_path / "lm"
    load_model("tiny-random").save_pretrained(lm)
    model = AutoModelForSequenceClassification.from_pretrained(lm, num_labels=1)
    tok = load_tokenizer("tiny-random")
    model.config.pad_token_id = tok.pad_token_id
    model.save_pretrained(rm)
    tok.save_pretrained(rm)
    out = tmp_path / "ev"
    assert eval_main(["model=tiny-random", "data=single_digit_add:all", "max_items=2", "n=3", "k=1,3", "max_new_tokens=4",
                      "select=best_of_n", f"select_reward=rm:{rm}", f"output_dir={out}"]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["selection"]["oracle"] is False and "sees no reference" in doc["selection"]["by"]
    scorer = RewardModelScorer(str(rm), device="cpu")
    for it in doc["items"]:
        prompt = [{"role": "user", "content": it["question"]}]
        scores = scorer([prompt] * 3, [s["text"] for s in it["samples"]])
        assert it["selection"]["selected"]["3"] == scores.index(max(scores))
        assert it["bon@3"] == it["correct"][scores.index(max(scores))]


def test_equal_tokens_by_hand():
    """One problem, samples of 10 tokens, right / wrong / wrong with answers 5, 7, 7: a 10-token budget keeps one
    random sample (right with p 1/3), 30 tokens keeps all three: best-of-N right, majority (7) wrong."""
    from posttrain.eval.selection import at_budget, equal_tokens

    item = {"id": "0", "samples": [{"tokens": 10}] * 3, "correct": [1, 0, 0], "scores": [1.0, 0.0, 0.0], "classes": [0, 1, 1]}
    doc = {"items": [item]}
    [one] = at_budget(doc, 10, orders=3000)
    assert one["m"] == 1 and one["tokens"] == 10 and one["bon"] == pytest.approx(1 / 3, abs=0.03)
    [allthree] = at_budget(doc, 30, orders=50)
    assert (allthree["m"], allthree["bon"], allthree["maj"]) == (3, 1.0, 0.0)
    [two] = at_budget(doc, 25, orders=3000)  # two of three: the right one among them with p 2/3; majority right only on 5 before 7 (1/3)
    assert two["bon"] == pytest.approx(2 / 3, abs=0.03) and two["maj"] == pytest.approx(1 / 3, abs=0.03)
    r = equal_tokens(doc, doc, budgets=(30,), orders=20)["rows"][0]
    assert r["b_maj_minus_a_maj"]["value"] == 0.0 and r["a"]["best_of_n"]["value"] == 1.0
    with pytest.raises(ValueError, match="no samples or answer classes"):
        at_budget({"items": [{"id": "x", "correct": [1]}]}, 10)
