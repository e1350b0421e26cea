"""`posttrain eval contamination mode=completion`: the memorisation probe, with a deterministic stub model that
has memorised some items (it continues them with their true rest) and not others."""

import json

import pytest

from conftest import write_jsonl
from posttrain.eval.memorization import edit_distance, edit_similarity, item_text, probe, split_ids

TEXTS = [f"Problem {i}: a train leaves station {i} at {i + 3} o'clock going {10 * i} miles per hour toward town" for i in range(10)]


def test_edit_similarity_by_hand():
    assert edit_distance(list("kitten"), list("sitting")) == 3
    assert edit_similarity([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert edit_similarity([1, 2, 3, 4, 5], [1, 9, 3, 4, 5]) == pytest.approx(0.8)  # one substitution in 5
    assert edit_similarity([], []) == 1.0 and edit_similarity([1], []) == 0.0


def test_split_keeps_the_tokenizer_specials_and_cuts_the_tokens(tiny_tok):
    head, rest = split_ids(tiny_tok, TEXTS[0], 0.5)
    plain = tiny_tok.encode(TEXTS[0], add_special_tokens=False)
    assert head[len(head) - round(0.5 * len(plain)):] + rest == plain
    assert len(rest) == len(plain) - round(0.5 * len(plain))


def _stub(tok, memorised: set[int], one_off: set[int]):
    """A 'model' that continues a memorised item's prefix with its true rest, a one_off item with its rest with one
    token changed, anything else with a constant token."""
    rests = {tuple(split_ids(tok, t, 0.5)[0]): split_ids(tok, t, 0.5)[1] for t in TEXTS}
    order = {tuple(split_ids(tok, t, 0.5)[0]): i for i, t in enumerate(TEXTS)}

    def generate(jobs):
        out = []
        for head, m in jobs:
            i, rest = order[tuple(head)], rests[tuple(head)]
            if i in memorised:
                out.append(list(rest))
            elif i in one_off:
                out.append([rest[0] + 1 if rest[0] + 1 < 1000 else rest[0] - 1, *rest[1:]])
            else:
                out.append([7] * m)
        return out

    return generate


def test_memorised_items_are_exact_one_off_items_near(tiny_tok):
    rep = probe(TEXTS, list(range(10)), tiny_tok, _stub(tiny_tok, {0, 1, 2, 3}, {4, 5}), prefix=0.5, threshold=0.8)
    assert rep["items_probed"] == 10 and rep["items_skipped"] == 0
    assert rep["exact_rate"]["count"] == 4 and rep["exact_rate"]["value"] == pytest.approx(0.4)
    assert rep["near_rate"]["count"] == 6  # the memorised ones and the one-token-off ones (similarity 1 − 1/len ≥ 0.8)
    lo, hi = rep["exact_rate"]["low"], rep["exact_rate"]["high"]
    assert lo == pytest.approx(0.1682, abs=1e-3) and hi == pytest.approx(0.6873, abs=1e-3)  # Wilson 4 of 10
    assert [it["id"] for it in rep["worst"][:4]] == [0, 1, 2, 3] and all(it["exact"] for it in rep["worst"][:4])
    off = next(it for it in rep["items"] if it["id"] == 4)
    assert off["similarity"] == pytest.approx(1 - 1 / off["rest_tokens"]) and not off["exact"] and off["near"]
    clean = probe(TEXTS, list(range(10)), tiny_tok, _stub(tiny_tok, set(), set()))
    assert clean["exact_rate"]["count"] == 0 and clean["near_rate"]["count"] == 0


def test_short_items_are_skipped_and_fields_are_read(tiny_tok):
    rep = probe(["too short", TEXTS[0]], [1, 2], tiny_tok, _stub(tiny_tok, {0}, set()), min_tokens=8)
    assert rep["items_skipped"] == 1 and rep["items_probed"] == 1 and rep["exact_rate"]["value"] == 1.0
    assert item_text({"prompt": [{"role": "user", "content": "hello"}], "answer": "5"}, ("prompt",)) == "hello"


def test_cli_runs_the_probe_on_a_model_and_refuses_misuse(tmp_path, capsys):
    from posttrain.config import ConfigError
    from posttrain.errors import UserError
    from posttrain.eval.contamination import main

    data = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": t} for t in TEXTS[:3]])
    out = tmp_path / "probe.json"
    assert main(["mode=completion", "model=tiny-random", f"eval={data}", f"output={out}", "max_model_len=256"]) == 0
    rep = json.loads(out.read_text())
    assert rep["items_probed"] == 3 and rep["model"] == "tiny-random" and 0 <= rep["near_rate"]["value"] <= 1
    assert "memorisation probe of tiny-random" in capsys.readouterr().out
    with pytest.raises(UserError, match="mode=completion model=MODEL"):
        main(["mode=completion", f"eval={data}"])
    with pytest.raises(ConfigError, match="prefix"):
        main(["mode=completion", "model=tiny-random", f"eval={data}", "prefix=1.5"])
    with pytest.raises(ConfigError, match="mode"):
        main(["mode=verbatim", f"eval={data}"])
