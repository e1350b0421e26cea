"""`posttrain eval` end to end on the tiny random model, `eval compare`, `eval contamination`, the code task."""

import copy
import json

import pytest

from conftest import write_jsonl
from posttrain.cli import main as cli
from posttrain.errors import DataError, UserError
from posttrain.eval import compare as C
from posttrain.eval.contamination import overlap

pytestmark = pytest.mark.timeout(300)

# a deterministic verifier that a random model passes about half the time: an even number of characters
EVEN = "def even(completions, **kw):\n    return [float(len(c) % 2 == 0) for c in completions]\n"


def run_eval(tmp_path, name, *args):
    out = tmp_path / name
    assert cli(["eval", "model=tiny-random", f"output_dir={out}", "max_new_tokens=6", *args]) == 0
    return json.loads((out / "results.json").read_text()), out


@pytest.fixture(scope="module")
def math_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    return run_eval(tmp, "math", "data=single_digit_add:all", "max_items=6", "n=3", "k=1,2,3")


def test_eval_writes_results_with_protocol_and_report(math_run):
    doc, out = math_run
    p = doc["protocol"]
    assert p["n"] == 3 and p["seed"] == 0 and p["sampling"]["temperature"] == 1.0 and p["sampling"]["max_new_tokens"] == 6
    assert p["chat_template"]["applied"] and "<|im_start|>" in p["chat_template"]["text"] and len(p["chat_template"]["sha256"]) == 64
    assert p["data"]["items"] == 6 and len(p["data"]["hash"]) == 64 and len(p["model"]["sha256"]) == 64
    assert p["reward"]["spec"] == "math" and p["extraction"]["mode"] == "auto"
    assert "What is 1 + 1?" in p["example_prompt"]
    assert set(doc["metrics"]) >= {"pass@1", "pass@2", "pass@3", "pass^2", "cons@3", "mean@n"}
    for m in doc["metrics"].values():
        assert m["low"] <= m["value"] <= m["high"]
    assert [r["k"] for r in doc["curve"]] == [1, 2, 3]
    html = (out / "report.html").read_text()
    assert 'src="passk.png"' in html and (out / "passk.png").is_file() and "What is 1 + 1?" in html
    for it in doc["items"]:
        assert len(it["samples"]) == len(it["correct"]) == len(it["answers"]) == len(it["classes"]) == 3
        assert it["c"] == sum(it["correct"]) and it["pass@1"] == pytest.approx(it["c"] / 3)


def test_metrics_are_the_means_of_the_items(tmp_path):
    reward = tmp_path / "even.py"
    reward.write_text(EVEN)
    doc, _ = run_eval(tmp_path, "even", "data=single_digit_add:all", "max_items=12", "n=4", f"reward={reward}:even", "threshold=0.5")
    items = doc["items"]
    assert 0 < sum(it["c"] for it in items) < 48  # the verifier is not constant on these samples
    for it in items:
        assert it["correct"] == [int(len(s["text"]) % 2 == 0) for s in it["samples"]]
    for name in ("pass@1", "pass@2", "pass@4", "pass^2", "mean@n"):
        assert doc["metrics"][name]["value"] == pytest.approx(sum(it[name] for it in items) / len(items))
    assert "cons@2" not in doc["metrics"]  # no math verifier, no answers to vote on
    assert doc["protocol"]["extraction"]["mode"] is None


def test_same_seed_same_samples_and_compare_finds_no_difference(tmp_path, math_run, capsys):
    doc_a, out_a = math_run
    doc_b, out_b = run_eval(tmp_path, "again", "data=single_digit_add:all", "max_items=6", "n=3", "k=1,2,3")
    assert [it["samples"] for it in doc_a["items"]] == [it["samples"] for it in doc_b["items"]]
    assert cli(["eval", "compare", str(out_a / "results.json"), str(out_b)]) == 0
    printed = capsys.readouterr().out
    assert "B − A = +0.0000" in printed and "not significantly different" in printed


def _fake(values_a, values_b, n=2):
    """Two results files' worth of items: item i has values_a[i] (resp. b) correct samples of n."""
    def doc(vals, seed):
        items = [{"id": str(i), "correct": [1] * c + [0] * (n - c), "pass@1": c / n, "c": c, "n": n} for i, c in enumerate(vals)]
        return {"format": "posttrain.eval/1", "items": items,
                "protocol": {"model": {"name": "m"}, "seed": seed, "n": n, "data": {"hash": "h", "items": len(vals)},
                             "sampling": {"temperature": 1.0}}}
    return doc(values_a, 0), doc(values_b, 1)


def test_compare_detects_a_real_difference():
    a, b = _fake([0] * 30, [2] * 30)
    r = C.compare(a, b, resamples=500)
    # McNemar over 60 paired samples, all discordant the same way: p = 2 / 2^60
    assert r["mcnemar"]["b"] == 0 and r["mcnemar"]["c"] == 60 and r["mcnemar"]["p_value"] == pytest.approx(2 / 2**60)
    assert r["bootstrap"]["diff"] == 1.0 and r["significant"]


def test_compare_refuses_different_protocols():
    a, b = _fake([1, 2, 0], [1, 1, 2])
    b["protocol"]["sampling"]["temperature"] = 0.7
    with pytest.raises(UserError, match="sampling.temperature"):
        C.compare(a, b)
    r = C.compare(a, b, allow_protocol_diff=True, resamples=200)
    assert any("sampling.temperature" in w for w in r["warnings"])
    c = copy.deepcopy(a)
    c["items"] = c["items"][:2]
    c["protocol"]["data"]["items"] = 2
    with pytest.raises(UserError, match="data.items"):
        C.compare(a, c)
    with pytest.raises(UserError, match="metric 'cons@2'"):
        C.compare(a, copy.deepcopy(a), metric="cons@2")


def test_compare_cli_refuses_a_file_that_is_not_results(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(UserError, match="not a posttrain eval results file"):
        C.main([str(bad), str(bad)])


def test_bad_data_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    import posttrain.models.loading as loading

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the data was checked")

    monkeypatch.setattr(loading, "load_model", no_model)
    from posttrain.eval.cli import main as eval_main

    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1?", "answer": "2"}, {"prompt": "2+2?"}])
    with pytest.raises(DataError, match=r"d.jsonl:2: answer: missing"):
        eval_main(["model=tiny-random", f"data={data}", f"output_dir={tmp_path / 'o'}"])
    assert cli(["eval", "model=tiny-random", f"data={data}", "n=2", "k=4"]) == 2  # k > n: a config error, exit 2


def test_hf_backend_and_system_prompt_and_few_shot(tmp_path):
    shots = write_jsonl(tmp_path / "shots.jsonl", [{"prompt": "What is 2 + 2?", "completion": "4"}])
    doc, _ = run_eval(tmp_path, "hf", "data=single_digit_add:all", "max_items=2", "n=2", "backend=hf",
                      "system_prompt=Answer with a number.", f"few_shot={shots}")
    p = doc["protocol"]
    assert p["backend"] == "hf" and p["system_prompt"] == "Answer with a number."
    assert p["few_shot"] == [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]
    assert p["example_prompt"].startswith("<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?")
    assert all(len(it["samples"]) == 2 for it in doc["items"])


def test_code_task_reference_solutions_pass_and_broken_ones_fail():
    from posttrain.data.tasks import generate
    from posttrain.rewards.registry import compose

    rows = generate("humaneval_mini:all")
    assert len(rows) >= 10 and len({r["id"] for r in rows}) == len(rows)
    good = [r["messages"][1]["content"] for r in rows]
    broken = [g.replace("    return", "    return None  #", 1) if "    return" in g else g + "\nraise SystemExit" for g in good]
    scores = compose("code")([r["prompt"] for r in rows] * 2, good + broken, tests=[r["tests"] for r in rows] * 2)
    assert scores[:len(rows)] == [1.0] * len(rows)
    assert scores[len(rows):] == [0.0] * len(rows)


def test_code_task_runs_through_eval_with_the_code_verifier(tmp_path):
    doc, _ = run_eval(tmp_path, "code", "data=humaneval_mini:all", "max_items=3", "n=1")
    assert doc["protocol"]["reward"]["spec"] == "code"  # chosen because the rows carry tests
    assert [it["id"] for it in doc["items"]] == ["sum_of_squares", "is_palindrome", "count_vowels"]
    assert doc["counts"]["reward_errors"] == 0


def test_contamination_toy_pair(tmp_path, capsys):
    sentence = "the quick brown fox jumps over the lazy dog while seven tired cats watch from the warm windowsill"
    train = [{"text": "Preface. " + sentence.upper() + "!"}, {"messages": [{"role": "user", "content": "short question here about cats and dogs ok"}]}]
    evals = [
        {"prompt": " ".join(sentence.split()[2:16])},  # 14 words copied: contaminated
        {"prompt": "an entirely different sentence that shares no long run of words with the training text at all"},
        {"prompt": "Short question here, about cats and dogs ok?"},  # 9 words (< 13): matched as a whole
        {"prompt": "the lazy dog"},  # under min_words: skipped
    ]
    rep = overlap(train, evals, n=13)
    assert [it["contaminated"] for it in rep["items"]] == [True, False, True, False]
    assert [it["grams"] for it in rep["items"]] == [2, 5, 1, 0]  # 14 words -> 2 windows; 17 -> 5; whole; none
    assert rep["contaminated_fraction"] == 0.5 and rep["gram_fraction"] == pytest.approx(3 / 8)
    tr, ev = write_jsonl(tmp_path / "train.jsonl", train), write_jsonl(tmp_path / "eval.jsonl", evals)
    assert cli(["eval", "contamination", f"train={tr}", f"eval={ev}", f"output={tmp_path / 'c.json'}"]) == 0
    assert "2 of 4 evaluation items" in capsys.readouterr().out
    assert json.loads((tmp_path / "c.json").read_text())["contaminated_items"] == 2
