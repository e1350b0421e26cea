"""`posttrain eval compare A B curve=true`: pass@k of both runs at every k, the paired interval of B − A at each k,
and the sharpening / expanding / unclear verdict, on constructed results with hand-derived values."""

import json

import pytest

from posttrain.errors import UserError
from posttrain.eval import compare as C
from posttrain.eval.curve import classify, curve_compare


def _doc(cs, n=8, seed=0):
    items = [{"id": str(i), "correct": [1] * c + [0] * (n - c), "pass@1": c / n, "c": c, "n": n} for i, c in enumerate(cs)]
    return {"format": "posttrain.eval/1", "items": items,
            "protocol": {"model": {"name": f"m{seed}"}, "seed": seed, "n": n, "data": {"hash": "h", "items": len(cs)},
                         "sampling": {"temperature": 1.0}}}


def _curve(ca, cb, n=8):
    return curve_compare(_doc(ca, n)["items"], _doc(cb, n)["items"], resamples=1000)


def test_every_k_with_the_unbiased_estimator():
    cur = _curve([2] * 20, [7] * 20)
    assert cur["ks"] == list(range(1, 9))
    k2 = cur["rows"][1]
    assert k2["a"]["value"] == pytest.approx(1 - 15 / 28)  # 1 − C(6,2)/C(8,2)
    assert k2["b"]["value"] == pytest.approx(1.0)  # one wrong sample: any 2 hold a right one
    assert cur["rows"][0]["diff"]["value"] == pytest.approx(7 / 8 - 2 / 8)


def test_sharpening_pass1_up_passk_flat():
    """Every problem: A 2 of 8 right, B 7 of 8: pass@1 +0.625, pass@8 = 1 for both (difference exactly 0)."""
    cur = _curve([2] * 20, [7] * 20)
    last = cur["rows"][-1]["diff"]
    assert (last["value"], last["low"], last["high"]) == (0.0, 0.0, 0.0)
    assert cur["verdict"] == "sharpening" and "flat" in cur["reason"]


def test_sharpening_passk_down():
    """B solves 15 of 20 problems always and 5 never; A solves each 2 of 8 times: pass@1 0.25 -> 0.75, pass@8 1 -> 0.75."""
    cur = _curve([2] * 20, [8] * 15 + [0] * 5)
    assert cur["rows"][-1]["diff"]["value"] == pytest.approx(-0.25) and cur["rows"][-1]["diff"]["high"] < 0
    assert cur["verdict"] == "sharpening" and "down" in cur["reason"]


def test_expanding_up_at_large_k_too():
    """A never solves half the problems (pass@8 = 0.5); B solves all 6 of 8 times (pass@8 = 1)."""
    cur = _curve([0] * 10 + [2] * 10, [6] * 20)
    assert cur["rows"][-1]["diff"]["value"] == pytest.approx(0.5) and cur["rows"][-1]["diff"]["low"] > 0
    assert cur["verdict"] == "expanding"


def test_unclear_cases():
    assert _curve([3] * 20, [3] * 20)["verdict"] == "unclear"  # no change at all
    assert "only k = 1" in _curve([0] * 5, [1] * 5, n=1)["reason"]
    row = lambda k, v, lo, hi: {"k": k, "diff": {"value": v, "low": lo, "high": hi}}
    verdict, reason = classify([row(1, 0.2, 0.1, 0.3), row(16, 0.1, -0.05, 0.35)])  # K's interval reaches past the pass@1 gain
    assert verdict == "unclear" and "too wide" in reason


def test_results_without_counts_are_refused():
    a, b = _doc([1, 2]), _doc([2, 2])
    del b["items"][1]["c"]
    with pytest.raises(UserError, match=r"problem '1' has no valid sample counts"):
        curve_compare(a["items"], b["items"], "A.json", "B.json")


def test_cli_prints_the_curve_and_writes_the_svg_page(tmp_path, capsys):
    pa, pb, page = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "curve.html"
    pa.write_text(json.dumps(_doc([2] * 20)))
    pb.write_text(json.dumps(_doc([7] * 20, seed=1)))
    assert C.main([str(pa), str(pb), "curve=true", f"report={page}", "bootstrap=500"]) == 0
    out = capsys.readouterr().out
    assert "=> sharpening" in out and "     8   0.9999" not in out
    text = page.read_text()
    assert text.count("<svg") == 2 and text.count("<polyline") == 3 and "sharpening" in text
    with pytest.raises(UserError, match="give curve=true"):
        C.main([str(pa), str(pb), f"report={page}"])
