"""`posttrain eval rank`: Bradley–Terry over pairwise results with bootstrap intervals; the input forms and the
refusals of malformed ones."""

import json
import math

import pytest

from conftest import write_jsonl
from posttrain.errors import DataError, UserError
from posttrain.eval.rank import main, rank, read_comparisons

sig = lambda x: 1 / (1 + math.exp(-x))


def test_three_players_with_known_strengths_are_recovered():
    """Soft outcomes equal to σ(β_i − β_j) with β = (0, 1, 2): the maximum-likelihood fit returns β (up to the
    1e-4 L2 penalty), Elo = 1000 + 400 β / ln 10."""
    beta = {"a": 0.0, "b": 1.0, "c": 2.0}
    comps = [(i, j, sig(beta[i] - beta[j])) for i in beta for j in beta if i < j] * 10
    r = rank(comps, anchor="a", resamples=0)
    got = {x["model"]: x for x in r["ranking"]}
    assert [x["model"] for x in r["ranking"]] == ["c", "b", "a"]
    for m, b in beta.items():
        assert got[m]["strength"] == pytest.approx(b, abs=2e-3)
        assert got[m]["elo"] == pytest.approx(1000 + 400 * b / math.log(10), abs=0.5)


def test_arena_winners_two_players_and_the_bootstrap(tmp_path):
    """B beats A 3 times of 4: σ(β_B − β_A) = 3/4, so β_B − β_A = ln 3 = 1.0986 (Elo +190.8)."""
    rows = [{"model_a": "A", "model_b": "B", "winner": "model_b"}] * 3 + [{"model_a": "B", "model_b": "A", "winner": "model_b"}]
    comps, _ = read_comparisons([write_jsonl(tmp_path / "battles.jsonl", rows * 10)])
    r = rank(comps, anchor="A", resamples=300, seed=1)
    top = r["ranking"][0]
    assert top["model"] == "B" and top["strength"] == pytest.approx(math.log(3), abs=2e-3)
    assert top["elo_low"] < top["elo"] < top["elo_high"] and top["wins"] == 30 and top["losses"] == 10
    assert r["resamples_used"] == 300 and (top["rank_low"], top["rank_high"]) == (1, 1)


def test_label_files_ties_within_policy_rows_and_cli(tmp_path, capsys):
    """`posttrain label` rows: source.models names the sides; a tie is half a win; A:0 vs A:1 rows are skipped."""
    def row(chosen, tie=False, a="A:0", b="B:0", models=True):
        src = {"prompt_index": 0, "a": a, "b": b, "chosen": chosen}
        if models:
            src["models"] = {"A": "runs/sft/final", "B": "smollm2"}
        return {"prompt": "q", "chosen": "x", "rejected": "y", "source": src, **({"tie": True} if tie else {})}
    path = write_jsonl(tmp_path / "pairs.jsonl", [row("B:0"), row("B:0"), row("A:0", tie=True), row("A:0", a="A:0", b="A:1")])
    out = tmp_path / "rank.json"
    assert main([path, "bootstrap=50", f"output={out}"]) == 0
    r = json.loads(out.read_text())
    assert r["skipped_within_policy"] == 1 and r["comparisons"] == 3
    assert r["ranking"][0]["model"] == "smollm2" and r["ranking"][0]["wins"] == 2 and r["ranking"][0]["ties"] == 1
    assert "1 within-policy rows skipped" in capsys.readouterr().out
    old = write_jsonl(tmp_path / "old.jsonl", [row("B:0", models=False), row("A:0", models=False)])
    comps, _ = read_comparisons([old])
    assert {comps[0][0], comps[0][1]} == {"old:A", "old:B"}


@pytest.mark.parametrize("rows,match", [
    ([{"model_a": "x", "winner": "a"}], r"bad.jsonl:1: model_b: missing"),
    ([{"model_a": "x", "model_b": "x", "winner": "a"}], "cannot be compared with itself"),
    ([{"model_a": "x", "model_b": "y", "winner": "draw"}], r"winner.*must be one of"),
    ([{"model_a": "x", "model_b": "y", "preference": 1.5}], r"preference.*in \[0, 1\]"),
    ([{"prompt": "q", "chosen": "a", "rejected": "b", "source": {"a": "A:0", "b": "B:0", "chosen": "C:1"}}], "source.chosen"),
])
def test_malformed_rows_are_refused_naming_row_and_field(tmp_path, rows, match):
    with pytest.raises(DataError, match=match):
        read_comparisons([write_jsonl(tmp_path / "bad.jsonl", rows)])


def test_unusable_inputs_are_refused(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        read_comparisons([str(tmp_path / "nope.jsonl")])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(UserError, match="no comparisons"):
        read_comparisons([str(empty)])
    with pytest.raises(UserError, match="2 separate groups"):
        rank([("a", "b", 1.0), ("c", "d", 0.0)], resamples=0)
    with pytest.raises(UserError, match="anchor='z' is in no comparison"):
        rank([("a", "b", 1.0)], anchor="z", resamples=0)
    with pytest.raises(UserError, match="usage: posttrain eval rank"):
        main([])
