"""`posttrain rm probe`: its statistics (exact on small cases) and a run on a tiny reward model."""

import itertools
import json
import math

import pytest

from conftest import write_jsonl
from posttrain.rewards import probe_stats as st
from preference_synthetic import rule_pairs


def test_spearman_with_ties_and_monotone_maps():
    assert st.ranks([10, 20, 20, 5]) == [2, 3.5, 3.5, 1]
    assert st.spearman([1, 2, 3, 4], [10, 100, 1000, 10000]) == pytest.approx(1.0)  # any increasing map
    assert st.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # textbook: d = rank differences, ρ = 1 − 6 Σd² / (n(n²−1)) without ties
    x, y = [1, 2, 3, 4, 5], [2, 1, 4, 3, 5]
    assert st.spearman(x, y) == pytest.approx(1 - 6 * 4 / (5 * 24))
    assert math.isnan(st.spearman([1, 1, 1], [1, 2, 3]))


def test_best_of_n_is_the_exact_expectation_over_subsets():
    rewards, lengths = [0.3, -1.0, 2.0, 0.7, 1.1], [5.0, 9.0, 2.0, 7.0, 4.0]
    for n in range(1, 6):
        subsets = list(itertools.combinations(range(5), n))
        best = [max(s, key=lambda i: rewards[i]) for s in subsets]
        want_r = sum(rewards[i] for i in best) / len(subsets)
        want_l = sum(lengths[i] for i in best) / len(subsets)
        got_r, got_l = st.best_of_n(rewards, n, lengths)
        assert (got_r, got_l) == (pytest.approx(want_r), pytest.approx(want_l))
    assert st.best_of_n(rewards, 1)[0] == pytest.approx(sum(rewards) / 5)
    assert st.bon_kl_bound(1) == 0 and st.bon_kl_bound(64) == pytest.approx(math.log(64) - 63 / 64)


def test_calibration_buckets_and_ece():
    # margins of 0 predict 0.5 for both orders: perfectly calibrated whatever happened
    cal = st.calibration([0.0, 1.0], [0.0, 1.0], bins=10)
    assert cal["ece"] == pytest.approx(0.0) and cal["accuracy"] == 0.0
    # r_w − r_l = log 3: predicted 0.75 for the chosen, and the chosen always wins -> |1 − 0.75| in both buckets
    cal = st.calibration([math.log(3)] * 4, [0.0] * 4, bins=4)
    assert [b["count"] for b in cal["bins"]] == [4, 4] and cal["ece"] == pytest.approx(0.25) and cal["accuracy"] == 1.0


def test_adversarial_edits():
    text = "It is blue. The sky scatters light."
    assert st.ADVERSARIAL["list"](text) == "- It is blue.\n- The sky scatters light."
    assert st.ADVERSARIAL["repeat"](text).endswith("light. The sky scatters light.")
    assert st.ADVERSARIAL["hedging"](text).startswith("I might be wrong, but it is blue.")
    assert st.ADVERSARIAL["flattery"](text).endswith(st.FLATTERY)


def test_probe_run_writes_report(tmp_path):
    from posttrain.config import parse_args
    from posttrain.models.loading import load_tokenizer
    from posttrain.models.reward_head import load_reward_model
    from posttrain.recipes import rm_probe

    tok = load_tokenizer("tiny-random")  # an untrained head: the probes' mechanics, not a good RM
    load_reward_model("tiny-random", pad_token_id=tok.pad_token_id).save_pretrained(tmp_path / "rm" / "final")
    tok.save_pretrained(tmp_path / "rm" / "final")
    held = write_jsonl(tmp_path / "held.jsonl", rule_pairs(12, seed=5))
    cfg = parse_args(rm_probe.ProbeConfig, [f"rm={tmp_path / 'rm' / 'final'}", f"data={held}", "policy=tiny-random",
                                            "bon_n=8", "bon_prompts=2", "max_new_tokens=6", f"output_dir={tmp_path / 'probe'}",
                                            "device=cpu"])
    res = rm_probe.probe(cfg)
    assert res["bon"]["n"] == [1, 2, 4, 8] and res["bon"]["reward"] == sorted(res["bon"]["reward"])  # E[max] grows with N
    assert -1 <= res["length_bias"]["spearman_reward_length"] <= 1 and set(res["adversarial"]) == set(st.ADVERSARIAL)
    assert 0 <= res["calibration"]["ece"] <= 1
    saved = json.loads((tmp_path / "probe" / "probe.json").read_text())
    assert saved["warnings"] == res["warnings"]
    for name in ("report.html", "probe_length.png", "probe_calibration.png", "probe_adversarial.png", "probe_bon.png"):
        assert (tmp_path / "probe" / name).is_file(), name
    assert "probe_bon.png" in (tmp_path / "probe" / "report.html").read_text()
