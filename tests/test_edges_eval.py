"""Fuzz cases for `posttrain eval`, `eval compare`, `eval contamination`, `generate`, `score`, `label` and `report`
(tests/edges.py: each case works with a correct result, or stops with one clear line; finished work is kept)."""

import json
import shutil

import pytest

from edges import ERROR, WORKS, Case, classify, ids

pytestmark = pytest.mark.usefixtures("no_activation_probe")  # tests/conftest.py

EVAL = ["eval", "model=tiny-random", "data={prompts}", "reward=math", "output_dir={tmp}/e", "max_new_tokens=2"]
GEN = ["generate", "model=tiny-random", "data={prompts}", "output={tmp}/s.jsonl", "max_new_tokens=2"]
SCORE = ["score", "data={completions}", "reward=math", "output={tmp}/o.jsonl"]
CONTAM = ["eval", "contamination", "train={prompts}", "eval={prompts}"]
REPORT = ["report"]
RL = ["rl", "model=tiny-random", "data={prompts}", "reward=math", "output_dir={tmp}/out", "max_steps=1", "prompts_per_step=2",
      "group_size=2", "max_new_tokens=2", "eval.data={heldout}", "eval.n=1", "eval.max_items=2"]


def _file(name, text):
    def setup(tmp):
        (tmp / name).write_text(text)
    return setup


def _rows(name, rows):
    return _file(name, "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def _base_model(tmp):
    """A saved tiny model whose tokenizer has no chat template (what a base model ships)."""
    from posttrain.models.builtin import build_tiny
    from posttrain.models.loading import load_tokenizer

    tok = load_tokenizer("tiny-random")
    tok.chat_template = None
    build_tiny("tiny-random").save_pretrained(tmp / "base")
    tok.save_pretrained(tmp / "base")
    (tmp / "base" / "chat_template.jinja").unlink(missing_ok=True)


def _run_folder(summary: str | None, metrics: str = '{"step": 1, "loss": 1.5}\n'):
    def setup(tmp):
        (tmp / "run").mkdir()
        (tmp / "run" / "metrics.jsonl").write_text(metrics)
        if summary is not None:
            (tmp / "run" / "summary.json").write_text(summary)
    return setup


def _both(*setups):
    def setup(tmp):
        for s in setups:
            s(tmp)
    return setup


REWARDS = """
def boom(prompts, completions, **kw):
    raise ValueError("boom")

def nothing(prompts, completions, **kw):
    return [None] * len(completions)

def short(prompts, completions, **kw):
    return [1.0]

def words(prompts, completions, **kw):
    return ["a"] * len(completions)

def one_bad(prompts, completions, **kw):
    if "3" in completions:  # the batch fails, then row 2 alone when it is re-run sample by sample
        raise ValueError("bad row")
    return [0.0] * len(completions)
"""


# ---------------------------------------------------------------- checks


def _results(run, rel="e/results.json") -> dict:
    return run.json(rel)


def _metrics(*names, absent=()):
    def check(run):
        doc = _results(run)
        assert (run.tmp / "e" / "report.html").is_file()
        for name in names:
            m = doc["metrics"][name]
            assert 0.0 <= m["low"] <= m["value"] <= m["high"] <= 1.0, (name, m)
        for name in absent:
            assert name not in doc["metrics"], name
        c = sum(it["c"] for it in doc["items"])
        samples = sum(it["n"] for it in doc["items"])
        if "pass@1" in doc["metrics"]:
            assert doc["metrics"]["pass@1"]["value"] == pytest.approx(c / samples)
    return check


def _eval_logged(run):
    rows = [json.loads(x) for x in (run.tmp / "out" / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/pass@1" in r for r in rows), rows[-1]


def _same_samples(run):
    for it in _results(run)["items"]:
        texts = [s["text"] for s in it["samples"]]
        assert len(texts) == 3 and len(set(texts)) == 1, texts  # temperature 0: n greedy samples, all the same


def _one_token(run):
    assert all(s["tokens"] == 1 for it in _results(run)["items"] for s in it["samples"])


def _refused_one(run):
    doc = _results(run)
    assert doc["counts"]["refused"] == 1 and "error" in doc["items"][0] and doc["items"][1]["n"] == 1
    assert "1 refused" in run.out


def _compare_out(diff):
    def check(run):
        doc = run.json("cmp.json")
        assert doc["bootstrap"]["diff"] == pytest.approx(diff) and doc["a"]["value"] == doc["b"]["value"]
    return check


def _generated(n_lines, same=False):
    def check(run):
        rows = [json.loads(x) for x in (run.tmp / "s.jsonl").read_text().splitlines()]
        assert len(rows) == n_lines and all(r["token_ids"] for r in rows)
        if same:
            by_prompt = {}
            for r in rows:
                by_prompt.setdefault(r["prompt_index"], set()).add(r["text"])
            assert all(len(v) == 1 for v in by_prompt.values()), by_prompt
    return check


def _scored(weight):
    def check(run):
        rows = [json.loads(x) for x in (run.tmp / "o.jsonl").read_text().splitlines()]
        for r in rows:  # the completions are the gold answers: math gives 1, the sum is the weight
            assert r["rewards"] == {"math": 1.0} and r["reward"] == pytest.approx(weight), r
    return check


def _contaminated(fraction):
    def check(run):
        doc = run.json("c.json")
        assert doc["contaminated_fraction"] == pytest.approx(fraction) and doc["eval_rows"] == 8
    return check


# ---------------------------------------------------------------- eval compare inputs


def _results_copy(ws, edit, name="r.json"):
    """Setup writing a copy of the finished eval run's results.json, changed by `edit(doc)`."""
    def setup(tmp):
        doc = json.loads((ws.run("eval") / "results.json").read_text())
        edit(doc)
        (tmp / name).write_text(json.dumps(doc))
    return setup


def _drop(key):
    return lambda doc: doc.pop(key)


def _set_n(doc):
    doc["protocol"]["n"] = 4
    doc["protocol"]["sampling"]["temperature"] = 0.5


def _renumber(doc):
    for it in doc["items"]:
        it["id"] = f"other-{it['id']}"


def _no_pass1(doc):  # a results file evaluated with k=2 only
    for it in doc["items"]:
        it.pop("pass@1")


def _eq_folder(ws):
    def setup(tmp):
        shutil.copytree(ws.run("eval"), tmp / "lr=1e-4")
    return setup


def cases(ws):
    """The cases; those that need the finished eval run for their setup take the workspace."""
    return [
        # ---- eval: k, n and sampling at the edges
        Case("eval-k4-without-1", [*EVAL, "n=4", "k=4"], WORKS, check=_metrics("pass@4", "pass^4", "cons@4", absent=("pass@1",))),
        Case("eval-k-list-without-1", [*EVAL, "n=4", "k=2,4"], WORKS, check=_metrics("pass@2", "pass@4", absent=("pass@1",))),
        Case("eval-k-above-n", [*EVAL, "n=2", "k=4"], ERROR, ("k=[4]", "n=2")),
        Case("eval-k-zero", [*EVAL, "n=2", "k=0"], ERROR, ("k",)),
        Case("eval-k-not-a-number", [*EVAL, "n=2", "k=two"], ERROR, ("k",)),
        Case("eval-n1", [*EVAL, "n=1"], WORKS, check=_metrics("pass@1", "mean@n")),
        Case("eval-n0", [*EVAL, "n=0"], ERROR, ("n",)),
        Case("eval-temperature-0-n3", [*EVAL, "n=3", "sampling.temperature=0", "max_items=2"], WORKS, check=_same_samples),
        Case("eval-top-p-0", [*EVAL, "sampling.top_p=0"], ERROR, ("top_p",)),
        Case("eval-empty-stop-string", [*EVAL, "sampling.stop_strings=['']"], ERROR, ("stop_strings", "non-empty")),
        Case("eval-max-new-tokens-1", [*EVAL, "sampling.max_new_tokens=1", "max_items=2"], WORKS, check=_one_token),
        Case("eval-one-prompt-too-long", [*EVAL, "data={tmp}/long.jsonl", "max_model_len=32"], WORKS, check=_refused_one,
             setup=_rows("long.jsonl", [{"prompt": "word " * 60, "answer": "1"}, {"prompt": "What is 1 + 1?", "answer": "2"}])),
        # ---- nothing scored: an error after the samples are saved, never a pass@1 of 0.000
        Case("eval-every-prompt-too-long", [*EVAL, "data={tmp}/long.jsonl", "max_model_len=32"], ERROR,
             ("no sample was scored", "refused", "results.json"),
             setup=_rows("long.jsonl", [{"prompt": "word " * 60, "answer": "1"}, {"prompt": "word " * 70, "answer": "2"}])),
        Case("eval-reward-raises-on-every-sample", [*EVAL, "reward={tmp}/r.py:boom", "max_items=2"], ERROR,
             ("no sample was scored", "reward failed", "boom"), setup=_file("r.py", REWARDS)),
        Case("eval-reward-none-on-every-sample", [*EVAL, "reward={tmp}/r.py:nothing", "max_items=2"], ERROR,
             ("no sample was scored", "None"), setup=_file("r.py", REWARDS)),
        # ---- rewards and their options
        Case("eval-duplicate-reward", [*EVAL, "reward=math,math"], ERROR, ("'math' appears twice", "math:2")),
        Case("eval-unknown-reward", [*EVAL, "reward=maths"], ERROR, ("maths",)),
        Case("eval-reward-file-missing", [*EVAL, "reward={tmp}/nope.py:fn"], ERROR, ("nope.py",)),
        Case("eval-reward-args-not-in-reward", [*EVAL, "reward_args={code: {partial: true}}"], ERROR, ("code",)),
        Case("eval-reward-args-bogus-option", [*EVAL, "reward_args={math: {bogus: 1}}"], ERROR, ("bogus",)),
        # ---- the held-out evaluation of a training run (eval.* section): eval.reward_args reach the recipe's reward
        Case("rl-eval-reward-args-bogus", [*RL, "eval.reward_args={math: {bogus: 1}}"], ERROR, ("eval.reward_args", "bogus")),
        Case("rl-eval-reward-args-other-reward", [*RL, "eval.reward_args={code: {partial: true}}"], ERROR,
             ("eval.reward_args", "code")),
        Case("rl-eval-reward-args-used", [*RL, "eval.reward_args={math: {mode: last_number}}"], WORKS, check=_eval_logged),
        # ---- data
        Case("eval-one-row", [*EVAL, "data={one_prompt}", "n=2"], WORKS, check=_metrics("pass@1", "pass@2")),
        Case("eval-empty-data", [*EVAL, "data={empty}"], ERROR, ("empty.jsonl",)),
        Case("eval-max-items-above-data", [*EVAL, "data={one_prompt}", "max_items=50"], WORKS, check=_metrics("pass@1")),
        Case("eval-prompts-column", [*EVAL, "data={tmp}/p.jsonl"], ERROR, ("p.jsonl:1", "did you mean 'prompt'"),
             setup=_rows("p.jsonl", [{"prompts": "What is 1 + 1?", "answer": "2"}])),
        Case("eval-prompts-beside-prompt", [*EVAL, "data={tmp}/p.jsonl"], ERROR, ("p.jsonl:1", "prompts", "rename"),
             setup=_rows("p.jsonl", [{"prompt": "What is 1 + 1?", "prompts": "x", "answer": "2"}])),
        Case("eval-duplicate-ids", [*EVAL, "data={tmp}/p.jsonl"], ERROR, ("'a'", "twice"),
             setup=_rows("p.jsonl", [{"id": "a", "prompt": "x", "answer": "1"}, {"id": "a", "prompt": "y", "answer": "2"}])),
        Case("eval-own-system-and-system-prompt", [*EVAL, "data={tmp}/p.jsonl", "system_prompt=Be brief."], ERROR,
             ("p.jsonl:1", "system_prompt"),
             setup=_rows("p.jsonl", [{"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "x"}],
                                      "answer": "1"}])),
        Case("eval-few-shot-missing", [*EVAL, "few_shot={tmp}/shots.jsonl"], ERROR, ("shots.jsonl",)),
        Case("eval-unknown-chat-template", [*EVAL, "chat_template=nosuch"], ERROR, ("nosuch",)),
        Case("eval-base-model-string-prompts", [*EVAL, "model={tmp}/base", "max_items=2"], WORKS,
             check=_metrics("pass@1"), setup=_base_model),
        Case("eval-base-model-conversations", [*EVAL, "model={tmp}/base", "data={tmp}/c.jsonl"], ERROR,
             ("no chat template", "chat_template="),
             setup=_both(_base_model, _rows("c.jsonl", [{"prompt": [{"role": "user", "content": "x"}], "answer": "1"}]))),
        # ---- options
        Case("eval-unknown-key", [*EVAL, "temprature=0"], ERROR, ("temprature",)),
        Case("eval-short-sampling-key", [*EVAL, "temperature=0", "max_items=1"], WORKS,
             check=lambda run: _results(run)["protocol"]["sampling"]["temperature"] == 0 or pytest.fail("temperature")),
        Case("eval-unknown-backend", [*EVAL, "backend=tgi"], ERROR, ("backend",)),
        Case("eval-bad-device", [*EVAL, "device=tpu"], ERROR, ("device",)),
        Case("eval-n-not-a-number", [*EVAL, "n=many"], ERROR, ("n",)),
        Case("eval-unknown-select", [*EVAL, "n=2", "select=best"], ERROR, ("select",)),
        Case("eval-code-reward-without-tests", [*EVAL, "reward=code"], ERROR, ("prompts.jsonl:1", "tests")),
        Case("eval-output-dir-is-a-file", [*EVAL, "output_dir={tmp}/f"], ERROR, ("f",), setup=_file("f", "x")),
        # ---- eval compare
        Case("compare-self", ["eval", "compare", "{run:eval}/results.json", "{run:eval}", "output={tmp}/cmp.json"], WORKS,
             check=_compare_out(0.0), keep=("{run:eval}",)),
        Case("compare-path-with-equals", ["eval", "compare", "{tmp}/lr=1e-4/results.json", "{run:eval}", "output={tmp}/cmp.json"],
             WORKS, check=_compare_out(0.0), setup=_eq_folder(ws)),
        Case("compare-missing-protocol", ["eval", "compare", "{tmp}/r.json", "{run:eval}"], ERROR, ("r.json", "protocol"),
             setup=_results_copy(ws, _drop("protocol"))),
        Case("compare-missing-items", ["eval", "compare", "{tmp}/r.json", "{run:eval}"], ERROR, ("r.json", "items"),
             setup=_results_copy(ws, _drop("items"))),
        Case("compare-protocol-mismatch", ["eval", "compare", "{run:eval}", "{tmp}/r.json"], ERROR,
             ("protocols differ", "sampling.temperature", "allow_protocol_diff=true"), setup=_results_copy(ws, _set_n)),
        Case("compare-protocol-mismatch-allowed", ["eval", "compare", "{run:eval}", "{tmp}/r.json", "allow_protocol_diff=true",
                                                   "output={tmp}/cmp.json"], WORKS, check=_compare_out(0.0),
             setup=_results_copy(ws, _set_n)),
        Case("compare-one-path", ["eval", "compare", "{run:eval}"], ERROR, ("usage", "two results files")),
        Case("compare-missing-file", ["eval", "compare", "{tmp}/nope.json", "{run:eval}"], ERROR, ("nope.json",)),
        Case("compare-not-json", ["eval", "compare", "{tmp}/r.json", "{run:eval}"], ERROR, ("r.json", "not json"),
             setup=_file("r.json", "{oops")),
        Case("compare-not-results", ["eval", "compare", "{prompts}", "{run:eval}"], ERROR, ("prompts.jsonl",)),
        Case("compare-absent-metric", ["eval", "compare", "{run:eval}", "{run:eval}", "metric=pass@64"], ERROR, ("pass@64",)),
        Case("compare-output-over-an-input", ["eval", "compare", "{copy:eval}", "{run:eval}", "output={copy:eval}/results.json"],
             ERROR, ("results A file itself", "output="), keep=("{copy:eval}",)),
        Case("compare-different-problems", ["eval", "compare", "{run:eval}", "{tmp}/r.json"], ERROR, ("different problems",),
             setup=_results_copy(ws, _renumber)),
        Case("compare-metric-not-in-both", ["eval", "compare", "{run:eval}", "{tmp}/r.json"], ERROR, ("pass@1", "both have"),
             setup=_results_copy(ws, _no_pass1)),
        Case("compare-unknown-key", ["eval", "compare", "{run:eval}", "{run:eval}", "metrc=pass@1"], ERROR, ("metrc",)),
        # ---- eval contamination
        Case("contamination-self", [*CONTAM, "output={tmp}/c.json"], WORKS, check=_contaminated(1.0)),
        Case("contamination-fields-comma-list", [*CONTAM, "fields=prompt,answer", "output={tmp}/c.json"], WORKS,
             check=_contaminated(1.0)),
        Case("contamination-disjoint", [*CONTAM, "train={sft}", "output={tmp}/c.json"], WORKS, check=_contaminated(0.0)),
        Case("contamination-empty-train", [*CONTAM, "train={empty}"], ERROR, ("train=", "empty.jsonl", "no rows")),
        Case("contamination-field-no-row-has", [*CONTAM, "fields=question"], ERROR, ("fields=question", "prompt")),
        Case("contamination-items-too-short", [*CONTAM, "min_words=50"], ERROR, ("min_words=50",)),
        Case("contamination-output-over-train", ["eval", "contamination", "train={tmp}/t.jsonl", "eval={prompts}",
                                                 "output={tmp}/t.jsonl"], ERROR, ("train= file itself",),
             setup=_rows("t.jsonl", [{"prompt": "What is 1 + 1? Answer with the number, please, now."}]), keep=("{tmp}/t.jsonl",)),
        Case("contamination-no-train", ["eval", "contamination", "eval={prompts}"], ERROR, ("train=",)),
        Case("contamination-n-0", [*CONTAM, "n=0"], ERROR, ("n",)),
        Case("contamination-unknown-mode", [*CONTAM, "mode=exact"], ERROR, ("mode",)),
        # ---- generate
        Case("generate-n1", GEN, WORKS, check=_generated(8)),
        Case("generate-temperature-0-n3", [*GEN, "temperature=0", "n=3"], WORKS, check=_generated(24, same=True)),
        Case("generate-top-p-0", [*GEN, "top_p=0"], ERROR, ("top_p",)),
        Case("generate-empty-stop-string", [*GEN, "stop_strings=['']"], ERROR, ("stop_strings", "non-empty")),
        Case("generate-every-prompt-too-long", [*GEN, "data={tmp}/long.jsonl", "max_model_len=32"], ERROR,
             ("every prompt failed", "context holds 32", "s.jsonl"),
             setup=_rows("long.jsonl", [{"prompt": "word " * 60}, {"prompt": "word " * 70}])),
        Case("generate-max-new-tokens-0", [*GEN, "max_new_tokens=0"], ERROR, ("max_new_tokens",)),
        Case("generate-one-row", [*GEN, "data={one_prompt}", "max_new_tokens=1"], WORKS, check=_generated(1)),
        Case("generate-empty-data", [*GEN, "data={empty}"], ERROR, ("empty.jsonl",)),
        Case("generate-no-data", ["generate", "model=tiny-random", "output={tmp}/s.jsonl"], ERROR, ("data",)),
        Case("generate-hf-base-model-plain-text", [*GEN, "model={tmp}/base", "backend=hf", "data={one_prompt}"], WORKS,
             check=_generated(1), setup=_base_model),
        Case("generate-hf-base-model-conversations", [*GEN, "model={tmp}/base", "backend=hf", "data={tmp}/c.jsonl"], ERROR,
             ("no chat template", "chat_template="),
             setup=_both(_base_model, _rows("c.jsonl", [{"prompt": [{"role": "user", "content": "x"}]}]))),
        Case("generate-base-model-chatml", [*GEN, "model={tmp}/base", "chat_template=chatml", "data={tmp}/c.jsonl"], WORKS,
             check=_generated(1), setup=_both(_base_model, _rows("c.jsonl", [{"prompt": [{"role": "user", "content": "x"}]}]))),
        Case("generate-output-is-a-folder", [*GEN, "output={tmp}"], ERROR, ("output",)),
        # ---- score
        Case("score-works", SCORE, WORKS, check=_scored(1.0)),
        Case("score-weighted", [*SCORE, "reward=math:2.5"], WORKS, check=_scored(2.5)),
        Case("score-duplicate-reward", [*SCORE, "reward=math,math"], ERROR, ("'math' appears twice", "math:2")),
        Case("score-prompts-column", [*SCORE, "data={tmp}/c.jsonl"], ERROR, ("c.jsonl:1", "prompts", "`prompt`"),
             setup=_rows("c.jsonl", [{"prompts": "What is 1 + 1?", "completion": "2", "answer": "2"}])),
        Case("score-completions-column", [*SCORE, "data={tmp}/c.jsonl"], ERROR, ("c.jsonl:1", "completions", "`completion`"),
             setup=_rows("c.jsonl", [{"completion": "2", "completions": ["2"], "answer": "2"}])),
        Case("score-missing-completion", [*SCORE, "data={prompts}"], ERROR, ("prompts.jsonl:1", "completion")),
        Case("score-missing-answer", [*SCORE, "data={tmp}/c.jsonl"], ERROR, ("c.jsonl:1", "answer"),
             setup=_rows("c.jsonl", [{"completion": "2"}])),
        Case("score-empty", [*SCORE, "data={empty}"], ERROR, ("empty.jsonl",)),
        Case("score-unknown-reward", [*SCORE, "reward=mathh"], ERROR, ("mathh",)),
        Case("score-output-over-its-data", ["score", "data={tmp}/c.jsonl", "reward=math", "output={tmp}/c.jsonl"], ERROR,
             ("data= file itself",), setup=_rows("c.jsonl", [{"completion": "2", "answer": "2"}]), keep=("{tmp}/c.jsonl",)),
        Case("score-reward-wrong-length", [*SCORE, "reward={tmp}/r.py:short"], ERROR,
             ("4 reward error(s)", "completions.jsonl:1", "list of 4 values", "o.jsonl"), setup=_file("r.py", REWARDS)),
        Case("score-reward-not-numbers", [*SCORE, "reward={tmp}/r.py:words"], ERROR, ("non-number", "'a'"),
             setup=_file("r.py", REWARDS)),
        Case("score-reward-fails-on-one-row", [*SCORE, "reward={tmp}/r.py:one_bad"], ERROR,
             ("1 reward error(s)", "completions.jsonl:2", "bad row"), setup=_file("r.py", REWARDS)),
        Case("score-no-output", ["score", "data={completions}", "reward=math"], ERROR, ("output",)),
        # ---- report
        Case("report-not-a-run", [*REPORT, "{tmp}"], ERROR, ("not a run directory",)),
        Case("report-missing-folder", [*REPORT, "{tmp}/nope"], ERROR, ("nope", "no such folder")),
        Case("report-eval-folder", [*REPORT, "{run:eval}"], ERROR, ("results.json", "posttrain eval"), keep=("{run:eval}",)),
        Case("report-no-folder", REPORT, ERROR, ("usage",)),
        Case("report-two-folders", [*REPORT, "{tmp}", "{tmp}"], ERROR, ("usage",)),
        Case("report-rebuilds-a-run", [*REPORT, "{copy:sft}"], WORKS, keep=("{copy:sft}/final", "{copy:sft}/checkpoints"),
             check=lambda run: (run.tmp / "copy-sft" / "report.html").is_file()),
        Case("report-truncated-summary", [*REPORT, "{tmp}/run"], WORKS, setup=_run_folder('{"steps": 1'),
             check=lambda run: (run.tmp / "run" / "report.html").is_file() and "summary.json" in run.err or pytest.fail(run.err)),
        Case("report-summary-not-an-object", [*REPORT, "{tmp}/run"], WORKS, setup=_run_folder("[1, 2]"),
             check=lambda run: (run.tmp / "run" / "report.html").is_file() or pytest.fail("no report")),
        Case("report-empty-metrics", [*REPORT, "{tmp}/run"], WORKS, setup=_run_folder(None, metrics=""),
             check=lambda run: (run.tmp / "run" / "report.html").is_file() or pytest.fail("no report")),
        Case("report-truncated-metrics-line", [*REPORT, "{copy:sft}"], WORKS, keep=("{copy:sft}/final",),
             setup=lambda tmp: None, check=lambda run: (run.tmp / "copy-sft" / "report.html").is_file()),
    ]


@pytest.fixture(scope="module")
def all_cases(workspace):
    return cases(workspace)


CASE_IDS = ids(cases(None))


@pytest.mark.parametrize("index", range(len(CASE_IDS)), ids=CASE_IDS)
def test_case(index, all_cases, workspace, tmp_path):
    case = all_cases[index]
    if case.id == "report-truncated-metrics-line":  # a run killed mid-write leaves half a line at the end
        run_dir = tmp_path / "copy-sft"
        shutil.copytree(workspace.run("sft"), run_dir)
        with (run_dir / "metrics.jsonl").open("a") as f:
            f.write('{"step": 3, "loss": 0.')
    classify(case, workspace, tmp_path)


def test_unscored_eval_keeps_its_samples_and_states_why(workspace, tmp_path):
    """No sample scored: results.json keeps every sample, has no metric (not a pass@1 of 0.000) and says why."""
    case = Case("unscored", [*EVAL, "reward={tmp}/r.py:boom", "max_items=2", "n=2"], ERROR, setup=_file("r.py", REWARDS))
    classify(case, workspace, tmp_path)
    doc = json.loads((tmp_path / "e" / "results.json").read_text())
    assert doc["metrics"] == {} and doc["curve"] == [] and "boom" in doc["unscored"]
    assert [len(it["samples"]) for it in doc["items"]] == [2, 2]
    assert "No sample was scored" in (tmp_path / "e" / "report.html").read_text()


# ---------------------------------------------------------------- label, with the fake judge (tests/fake_judge.py)

LABEL_CASES = [
    Case("label-works", ["label", "data={tmp}/p.jsonl", "samples_a={tmp}/a.jsonl", "judge.base_url={judge}",
                         "output={tmp}/pairs.jsonl"], WORKS),
    Case("label-no-judge", ["label", "data={tmp}/p.jsonl", "samples_a={tmp}/a.jsonl", "output={tmp}/pairs.jsonl"], ERROR,
         ("judge.base_url",)),
    Case("label-judge-unreachable", ["label", "data={tmp}/p.jsonl", "samples_a={tmp}/a.jsonl", "output={tmp}/pairs.jsonl",
                                     "judge.base_url=http://127.0.0.1:9/v1", "judge.retries=0"], ERROR, ("127.0.0.1:9",)),
    Case("label-prompt-index-out-of-range", ["label", "data={tmp}/p.jsonl", "samples_a={tmp}/bad.jsonl",
                                             "judge.base_url={judge}", "output={tmp}/pairs.jsonl"], ERROR,
         ("bad.jsonl:1", "prompt_index")),
    Case("label-samples-and-policy", ["label", "data={tmp}/p.jsonl", "samples_a={tmp}/a.jsonl", "policy_a=tiny-random",
                                      "judge.base_url={judge}", "output={tmp}/pairs.jsonl"], ERROR, ("samples_a", "policy_a")),
    Case("label-empty-prompts", ["label", "data={empty}", "samples_a={tmp}/a.jsonl", "judge.base_url={judge}",
                                 "output={tmp}/pairs.jsonl"], ERROR, ("empty.jsonl",)),
    Case("label-ties-bogus", ["label", "data={tmp}/p.jsonl", "samples_a={tmp}/a.jsonl", "judge.base_url={judge}",
                              "ties=maybe"], ERROR, ("ties",)),
]


def _label_inputs(tmp):
    (tmp / "p.jsonl").write_text("".join(json.dumps({"prompt": f"Say something about {i}."}) + "\n" for i in range(2)))
    samples = [{"prompt_index": i, "sample_index": j, "text": "x" * (1 + 5 * j + i)} for i in range(2) for j in range(2)]
    (tmp / "a.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    (tmp / "bad.jsonl").write_text(json.dumps({"prompt_index": 7, "sample_index": 0, "text": "x"}) + "\n")


@pytest.mark.parametrize("case", LABEL_CASES, ids=ids(LABEL_CASES))
def test_label_case(case, fake, workspace, tmp_path):
    case = Case(case.id, [a.replace("{judge}", fake.base_url) for a in case.argv], case.expect, case.mentions,
                setup=_label_inputs)
    run = classify(case, workspace, tmp_path)
    if case.expect == WORKS:  # the fake judge prefers the longer response: sample 1 (longer) is chosen for both prompts
        rows = [json.loads(x) for x in (tmp_path / "pairs.jsonl").read_text().splitlines()]
        assert [len(r["chosen"]) > len(r["rejected"]) for r in rows] == [True, True], rows
        assert "2 pairs judged" in run.out
