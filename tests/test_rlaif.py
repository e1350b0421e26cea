"""RLAIF: `reward=judge` (batched, cached on disk, failures reported, cost and latency in last_metrics) in a
3-step GRPO run, and `posttrain label` writing TRL preference pairs; all against a fake judge over HTTP."""

import json

import pytest

from conftest import write_jsonl
from posttrain.cli import main as cli
from posttrain.errors import UserError
from posttrain.rewards.base import RewardError
from posttrain.rewards.registry import compose


def judge_reward(fake, tmp_path, **opts):
    return compose("judge", options={"judge": {"base_url": fake.base_url, "cache": str(tmp_path / "cache.sqlite"), **opts}})


# ---------------------------------------------------------------- reward=judge


def test_judge_reward_scores_batches_and_caches(fake, tmp_path):
    r = judge_reward(fake, tmp_path, price_in_per_mtok=2.0, price_out_per_mtok=10.0, rubric="Prefer detail.")
    completions = ["x" * 5, "x" * 45, "x" * 45, "x" * 95]
    values = r(["q"] * 4, completions)
    assert values == pytest.approx([0.0, 4 / 9, 4 / 9, 1.0])  # ratings 1, 5, 5, 10 -> (s - 1) / 9
    m = r.last_metrics
    assert len(fake.requests) == 3 and m["rewards/judge/questions"] == 3  # the repeated completion is asked once
    assert m["rewards/judge/cache_hits"] == 0 and m["rewards/judge/failed"] == 0
    tokens_in, tokens_out = m["rewards/judge/prompt_tokens"], m["rewards/judge/completion_tokens"]
    assert tokens_in > 0 and m["rewards/judge/cost_usd"] == pytest.approx(tokens_in * 2e-6 + tokens_out * 1e-5)
    assert m["rewards/judge/latency_mean_s"] > 0 and m["rewards/judge/latency_max_s"] >= m["rewards/judge/latency_mean_s"]
    again = judge_reward(fake, tmp_path, rubric="Prefer detail.")  # a new process would see the same file
    assert again(["q"] * 4, completions) == values
    assert len(fake.requests) == 3 and again.last_metrics["rewards/judge/cache_hits"] == 4
    other = judge_reward(fake, tmp_path, rubric="Prefer brevity.")  # another rubric is another judge: no hits
    other(["q"], ["x" * 5])
    assert len(fake.requests) == 4 and other.last_metrics["rewards/judge/cache_hits"] == 0


def test_judge_reward_rubric_file_and_pairwise_mode(fake, tmp_path):
    constitution = tmp_path / "constitution.md"
    constitution.write_text("1. Be honest.\n2. Be harmless.\n")
    r = judge_reward(fake, tmp_path, rubric_file=str(constitution))
    r(["q"], ["an answer"])
    assert "1. Be honest.\n2. Be harmless." in fake.requests[-1]["messages"][-1]["content"]
    pw = judge_reward(fake, tmp_path, mode="pairwise", cache="")
    assert pw(["q", "q"], ["a long completion", "no"], reference=["mid size", "mid size"]) == [1.0, 0.0]
    fake.verdict = "first"
    assert pw(["q"], ["a long completion"], reference=["mid size"]) == [0.5]  # the orders disagree: a tie


def test_judge_reward_failures_are_none_or_raise_never_a_number(fake, tmp_path):
    fake.malformed_first = 10
    r = judge_reward(fake, tmp_path, retries=1, cache="")
    assert r(["q", "q"], ["one", "two"]) == [None, None]
    assert r.last_metrics["rewards/judge/failed"] == 2 and r.last_metrics["rewards/judge/none"] == 2
    assert r.last_metrics["rewards/judge/malformed"] == 4 and r.last_metrics["rewards/judge/retries"] == 2
    strict = judge_reward(fake, tmp_path, retries=0, on_failure="raise")
    with pytest.raises(RewardError, match="malformed"):
        strict(["q"], ["x" * 25])
    fake.malformed_first = 0
    assert strict(["q"], ["x" * 25]) == [pytest.approx(2 / 9)]  # rating 3; the failure was not cached


def test_judge_reward_is_refused_before_training(fake, tmp_path):
    with pytest.raises(UserError, match="needs options"):
        compose("judge")
    with pytest.raises(UserError, match="does not answer"):
        compose("judge", options={"judge": {"base_url": "http://127.0.0.1:9/v1", "timeout_s": 2}})
    with pytest.raises(UserError, match="rubric_fil: Extra inputs"):
        judge_reward(fake, tmp_path, rubric_fil="x.md")
    with pytest.raises(UserError, match="rubric_file not found"):
        judge_reward(fake, tmp_path, rubric_file=str(tmp_path / "missing.md"))


def test_grpo_with_the_judge_reward_runs_end_to_end(fake, tmp_path):
    """3 GRPO steps of the tiny policy, rewarded by the judge over HTTP; the RL recipe passes dataset
    columns and completion_ids, which the judge ignores."""
    from posttrain.config import parse_args
    from posttrain.recipes import rl

    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": [{"role": "user", "content": f"Describe {w}."}], "topic": w}
                                                    for w in ("rain", "snow", "wind", "fog")])
    cfg = parse_args(rl.RLConfig, [
        "model=tiny-random", f"data={data}", f"output_dir={tmp_path / 'run'}", "reward=judge",
        f"reward_args={{judge: {{base_url: '{fake.base_url}', cache: '{tmp_path / 'c.sqlite'}'}}}}",
        "prompts_per_step=2", "group_size=4", "max_new_tokens=16", "max_steps=3", "progress=false", "beta=0",
    ])
    summary = rl.train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and summary["steps"] == 3 and summary["skipped_steps"] == 0
    assert all(0 <= r["rewards/judge/mean"] <= 1 and r["rewards/judge/errors"] == 0 and r["rewards/judge/none"] == 0 for r in rows)
    asked = {r["messages"][-1]["content"] for r in fake.requests}
    assert len(fake.requests) == len(asked) >= 3  # every rating came from the judge, each distinct question asked once
    assert any(r["reward/std"] > 0 for r in rows)  # the judge's ratings vary with the completions' lengths


# ---------------------------------------------------------------- posttrain label


PROMPTS = [{"prompt": "Name a fruit."}, {"prompt": [{"role": "user", "content": "Name a tree."}]}, {"prompt": "Name a bird."}]


def samples(path, texts):
    """texts[prompt][sample] -> a file in `posttrain generate`'s format."""
    return write_jsonl(path, [{"prompt_index": i, "sample_index": j, "text": t, "token_ids": [], "logprobs": [], "finish_reason": "stop"}
                              for i, ts in enumerate(texts) for j, t in enumerate(ts)])


def label(tmp_path, fake, *args):
    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    out = tmp_path / "pairs.jsonl"
    code = cli(["label", f"data={data}", f"judge.base_url={fake.base_url}", f"output={out}", *args])
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    summary = json.loads((tmp_path / "pairs.jsonl.summary.json").read_text()) if code != 2 else None
    return code, rows, summary


def test_label_two_policies_writes_trl_preference_pairs(fake, tmp_path):
    a = samples(tmp_path / "a.jsonl", [["apple, crisp and sweet"], ["oak"], ["a robin in spring"]])
    b = samples(tmp_path / "b.jsonl", [["fig"], ["a tall pine on the hill"], ["a robin in spring"]])
    code, rows, s = label(tmp_path, fake, f"samples_a={a}", f"samples_b={b}")
    assert code == 0
    assert s["pairs_judged"] == 2 and s["identical_skipped"] == 1 and s["written"] == 2 and s["failed"] == 0
    assert rows[0]["prompt"] == "Name a fruit." and rows[0]["chosen"] == "apple, crisp and sweet" and rows[0]["rejected"] == "fig"
    assert rows[1]["prompt"] == [{"role": "user", "content": "Name a tree."}]  # conversational in, conversational out
    assert rows[1]["chosen"] == [{"role": "assistant", "content": "a tall pine on the hill"}]
    assert rows[1]["source"] == {"prompt_index": 1, "a": "A:0", "b": "B:0", "chosen": "B:0",  # models: for eval rank
                                 "models": {"A": str(tmp_path / "a.jsonl"), "B": str(tmp_path / "b.jsonl")}}
    assert rows[0]["judge"]["version"] == "pairwise-v1" and rows[0]["judge"]["orders"] == ["a", "a"]
    from posttrain.data.formats import load

    assert load(str(tmp_path / "pairs.jsonl"))[1] == "preference"  # ready for rm / dpo
    w = s["win_rate_a_vs_b"]
    assert w["n"] == 2 and w["win_rate"] == 50 and w["wins"] == w["losses"] == 1 and 0 < w["lc_win_rate"] < 100


def test_label_ties_dropped_or_kept_and_failures_reported(fake, tmp_path):
    a = samples(tmp_path / "a.jsonl", [["one", "two!", "three", "four"], ["x", "yy"], ["p", "qq"]])
    fake.verdict = "first"  # position bias only: every pair is a tie
    code, rows, s = label(tmp_path, fake, f"samples_a={a}", "pairs_per_prompt=2")
    assert code == 0 and rows == [] and s["pairs_judged"] == 4 and s["ties"] == 4 and s["written"] == 0
    code, rows, s = label(tmp_path, fake, f"samples_a={a}", "pairs_per_prompt=2", "ties=keep")
    assert len(rows) == 4 and all(r["tie"] for r in rows) and rows[0]["chosen"] == "one" and rows[1]["chosen"] == "three"
    fake.verdict, fake.malformed_first = "longer", 10
    code, rows, s = label(tmp_path, fake, f"samples_a={a}", "judge.retries=1")
    assert code == 1 and rows == [] and s["failed"] == 3 and "malformed" in s["errors"][0]["error"]
    assert s["judge"]["retries"] == 6 and s["judge"]["malformed"] == 12


def test_label_samples_a_policy_here(fake, tmp_path):
    """policy_a: the samples are drawn here with the engine (2 per prompt for one policy)."""
    code, rows, s = label(tmp_path, fake, "policy_a=tiny-random", "sampling.max_new_tokens=12", "seed=3")
    assert code == 0 and s["pairs_judged"] + s["identical_skipped"] == 3 and s["written"] == s["decided"] == s["pairs_judged"]
    assert all(len(r["chosen"]) >= len(r["rejected"]) for r in rows if isinstance(r["chosen"], str))


def test_label_relabels_preference_rows_and_reports_agreement(fake, tmp_path):
    human = write_jsonl(tmp_path / "human.jsonl", [{"prompt": f"q{i}", "chosen": "a long, detailed answer" if i % 3 else "ok",
                                                   "rejected": "short" if i % 3 else "a long, detailed answer"} for i in range(12)])
    out = tmp_path / "pairs.jsonl"
    assert cli(["label", f"data={human}", f"judge.base_url={fake.base_url}", f"output={out}"]) == 0
    s = json.loads((tmp_path / "pairs.jsonl.summary.json").read_text())
    a = s["agreement_with_file_labels"]
    assert a["n"] == 12 and a["agreement"] == pytest.approx(8 / 12)  # the length judge disagrees on every third row
    assert 0 < a["cohen_kappa"] < 1


def test_label_refuses_bad_input_before_judging(fake, tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt_index": 7, "text": "x"}])
    data = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    assert cli(["label", f"data={data}", f"judge.base_url={fake.base_url}", f"samples_a={bad}"]) == 2
    assert cli(["label", f"data={data}", f"judge.base_url={fake.base_url}"]) == 2  # no samples, no policy
    assert cli(["label", f"data={data}", "judge.base_url=http://127.0.0.1:9/v1", f"samples_a={bad}"]) == 2
    assert fake.requests == []
