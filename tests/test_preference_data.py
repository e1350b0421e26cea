"""Preference data: TRL's formats, the refusals (file, row, field), tokenization and the shared-prefix layout."""

import json

import pytest
import torch

from conftest import write_jsonl
from posttrain.cli import main as cli
from posttrain.data import preference as pref
from posttrain.data.prefix_batch import build, micro_batches
from posttrain.errors import DataError

Q = [{"role": "user", "content": "What color is the sky?"}]
A_BLUE = [{"role": "assistant", "content": "It is blue."}]
A_GREEN = [{"role": "assistant", "content": "It is green."}]
GOOD = {"prompt": Q, "chosen": A_BLUE, "rejected": A_GREEN}


def test_explicit_implicit_conversational_and_plain(tmp_path):
    rows = [
        GOOD,
        {"prompt": Q, "chosen": Q + A_BLUE, "rejected": Q + A_GREEN},  # whole conversations: the prompt is cut off
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green.", "margin": 2},
    ]
    pairs = pref.load_pairs(write_jsonl(tmp_path / "p.jsonl", rows))
    assert pairs[1].chosen == A_BLUE and pairs[1].rejected == A_GREEN and pairs[1].prompt == Q
    assert pairs[2].margin == 2.0 and pairs[0].margin is None and pairs[2].row.number == 3
    implicit = pref.load_pairs(write_jsonl(tmp_path / "i.jsonl", [
        {"chosen": Q + A_BLUE, "rejected": Q + A_GREEN},
        {"chosen": "The sky is blue.", "rejected": "The sky is green."},
    ]))
    assert implicit[0].prompt == Q and implicit[0].chosen == A_BLUE
    # TRL's extract_prompt: the space before the first difference stays with the completions
    assert (implicit[1].prompt, implicit[1].chosen, implicit[1].rejected) == ("The sky is", " blue.", " green.")


def test_unpair_like_trl_and_unpaired_format(tmp_path):
    pairs = pref.load_pairs(write_jsonl(tmp_path / "p.jsonl", [GOOD, {"prompt": "x", "chosen": "a", "rejected": "b"}]))
    un = pref.unpair(pairs)
    assert [(u.completion, u.label) for u in un] == [(A_BLUE, True), ("a", True), (A_GREEN, False), ("b", False)]
    rows = pref.load_preference(write_jsonl(tmp_path / "u.jsonl", [{"prompt": "x", "completion": "a", "label": False}]),
                                unpaired_ok=True)
    assert rows[0].label is False and isinstance(rows[0], pref.Unpaired)


BAD = [  # (name, rows, bad row, field, problem)
    ("chosen identical to rejected", [GOOD, {"prompt": Q, "chosen": A_BLUE, "rejected": A_BLUE}], 2, "rejected", "identical to chosen"),
    ("missing prompt", [GOOD, GOOD, {"chosen": A_BLUE, "rejected": A_GREEN}], 3, "prompt", "missing prompt"),
    ("empty prompt", [{"prompt": "  ", "chosen": "a", "rejected": "b"}], 1, "prompt", "missing prompt"),
    ("implicit prompt absent", [{"chosen": "blue sky", "rejected": "green sky"}], 1, "chosen", "missing prompt"),
    ("empty completion", [GOOD, {"prompt": "q", "chosen": "a", "rejected": "   "}], 2, "rejected", "empty completion"),
    ("no assistant turn", [{"prompt": Q, "chosen": A_BLUE, "rejected": Q + [{"role": "user", "content": "hm"}]}], 1,
     "rejected", "no assistant turn"),
    ("conversation does not start with the prompt", [GOOD, {"prompt": Q, "chosen": [{"role": "user", "content": "other"}] + A_BLUE,
                                                            "rejected": A_GREEN}], 2, "chosen[0]", "does not start with the prompt"),
    ("number as completion", [{"prompt": "q", "chosen": 3, "rejected": "b"}], 1, "chosen", "must be a string or a list"),
    ("string prompt, conversational completions", [{"prompt": "q", "chosen": A_BLUE, "rejected": A_GREEN}], 1, "chosen",
     "the prompt is a string"),
    ("margin not a number", [{"prompt": "q", "chosen": "a", "rejected": "b", "margin": "big"}], 1, "margin", "finite number"),
    ("bad message", [{"prompt": Q, "chosen": [{"role": "assistant"}], "rejected": A_GREEN}], 1, "chosen[0]", "missing key 'content'"),
]


@pytest.mark.parametrize("name,rows,row,field,problem", BAD, ids=[b[0] for b in BAD])
def test_bad_pairs_are_refused_naming_file_row_field(tmp_path, name, rows, row, field, problem):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError) as e:
        pref.load_pairs(path)
    assert (e.value.source, e.value.row, e.value.field) == (path, row, field) and problem in e.value.problem, str(e.value)


def test_bad_unpaired_label(tmp_path):
    path = write_jsonl(tmp_path / "u.jsonl", [{"prompt": "x", "completion": "a", "label": "yes"}])
    with pytest.raises(DataError) as e:
        pref.load_preference(path, unpaired_ok=True)
    assert (e.value.row, e.value.field) == (1, "label")


@pytest.mark.parametrize("command", ["dpo", "rm"])
def test_commands_refuse_bad_data_before_any_model_loads(tmp_path, capsys, monkeypatch, command):
    import posttrain.models.loading as loading

    monkeypatch.setattr(loading, "_build", lambda *a, **k: pytest.fail("a model was loaded"))
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, GOOD, {"prompt": Q, "chosen": A_GREEN, "rejected": A_GREEN}])
    out = tmp_path / "run"
    assert cli([command, "model=tiny-random", f"data={path}", f"output_dir={out}", "max_steps=2"]) == 2
    assert f"{path}:3: rejected: identical to chosen" in capsys.readouterr().err
    assert not (out / "metrics.jsonl").exists()


def test_tokenized_pair_shares_the_prompt_and_ends_at_the_last_trained_token(tiny_tok):
    from posttrain.data.templates import render_prompt, render_prompt_completion

    pair = pref.Pair(Q, A_BLUE, A_GREEN, row=None)
    [tp] = pref.tokenize(tiny_tok, [pair])
    assert tp.prompt_ids == render_prompt(tiny_tok, Q)  # the prompt with its generation header
    full = render_prompt_completion(tiny_tok, Q, A_BLUE)
    chosen = tp.continuations[0]
    assert tp.prompt_ids + chosen.input_ids == full.input_ids[: len(tp.prompt_ids) + len(chosen)]
    assert all(chosen.loss_mask) and chosen.input_ids[-1] == tiny_tok.convert_tokens_to_ids("<|im_end|>")
    # plain strings: completion + EOS trained
    [tp] = pref.tokenize(tiny_tok, [pref.Pair("The sky is", " blue.", " green.", row=None)])
    assert tp.continuations[1].input_ids[-1] == tiny_tok.eos_token_id and all(tp.continuations[1].loss_mask)


def _naive_logps(model, prompt, cont):
    ids = torch.tensor([prompt + cont.input_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
    total = 0.0
    for j, m in enumerate(cont.loss_mask):
        if m:
            total += float(logp[len(prompt) + j - 1, cont.input_ids[j]])
    return total


def test_shared_prefix_forward_equals_separate_forwards(tiny_tok):
    """Chosen and rejected after one prompt, packed with other pairs, give each sequence's own log-prob."""
    from posttrain.models.loading import load_model
    from posttrain.recipes.reference_cache import sequence_logps

    model = load_model("tiny-random")
    pairs = [pref.Pair([{"role": "user", "content": f"Question {i} about " + "words " * i}],
                       [{"role": "assistant", "content": "yes " * (i + 1)}], [{"role": "assistant", "content": "no"}], row=None)
             for i in range(4)]
    tps = pref.tokenize(tiny_tok, pairs)
    groups = [(t.prompt_ids, t.continuations) for t in tps]
    [(batch, idx)] = micro_batches(groups, tiny_tok.pad_token_id, 4096)
    assert idx == [0, 1, 2, 3] and batch.input_ids.shape == (1, 64 * -(-sum(len(t) for t in tps) // 64))
    with torch.no_grad():
        got = sequence_logps(model, batch)
    want = [_naive_logps(model, t.prompt_ids, c) for t in tps for c in t.continuations]
    n_tok = max(len(c) for t in tps for c in t.continuations)
    # fp32 sums of n_tok terms of magnitude ~log V ≈ 7, computed in another order: |Δ| ≲ n_tok · 7 · 1e-6
    assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), atol=n_tok * 7 * 1e-6), (got, want)
    # split into several rows by the token budget: the same values
    small = micro_batches(groups, tiny_tok.pad_token_id, max(len(t) for t in tps))
    assert len(small) == 4
    with torch.no_grad():
        again = torch.cat([sequence_logps(model, b) for b, _ in small])
    assert torch.allclose(again, got, atol=n_tok * 7 * 1e-6)


def test_last_index_is_the_last_non_pad_token():
    from posttrain.data.templates import Tokenized

    b = build([([5, 6], [Tokenized([7, 3, 3], [1, 1, 1]), Tokenized([8], [1])])], pad_id=3, pad_to_multiple_of=8)
    assert b.last_index.tolist() == [2, 5] and b.loss_tokens.tolist() == [3, 1]
    assert b.hidden_index.tolist() == [1, 2, 3, 1] and b.seq_index.tolist() == [0, 0, 0, 1]
    assert b.layout == (((2, (3, 1)), (2, ())),) and json.dumps(b.position_ids.tolist()) == "[[0, 1, 2, 3, 4, 2, 0, 1]]"


def test_plain_replies_after_a_conversational_prompt_are_assistant_turns(tmp_path):
    pairs = pref.load_pairs(write_jsonl(tmp_path / "p.jsonl", [{"prompt": Q, "chosen": "It is blue.", "rejected": "Green."}]))
    assert pairs[0].chosen == A_BLUE and pairs[0].rejected == [{"role": "assistant", "content": "Green."}]
    with pytest.raises(DataError) as e:
        pref.load_pairs(write_jsonl(tmp_path / "e.jsonl", [{"prompt": Q, "chosen": "It is blue.", "rejected": " "}]))
    assert (e.value.row, e.value.field) == (1, "rejected") and "empty completion" in e.value.problem
