"""`posttrain dpo mask_special_tokens=true` (Llama 3 §4.1.4: special/template tokens out of the log-prob sums) and
the length-growth alarm naming the length-normalised losses."""

from __future__ import annotations

import io

import pytest

from conftest import write_jsonl
from posttrain.config import parse_args
from posttrain.data.preference import TokenizedPair, render_sequences
from posttrain.data.special_tokens import mask_special, special_token_ids
from posttrain.errors import DataError
from posttrain.models.loading import load_tokenizer
from posttrain.monitor.preference_alarms import PreferenceAlarms
from posttrain.recipes import dpo
from preference_synthetic import rule_pairs


def test_special_tokens_lose_their_loss_mask_only():
    tok = load_tokenizer("tiny-random")
    special = special_token_ids(tok)
    assert special == {tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")}
    prompt, conts = render_sequences(tok, [{"role": "user", "content": "hi"}],
                                     [[{"role": "assistant", "content": "yes"}], [{"role": "assistant", "content": "no"}]])
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert all(c.input_ids[-1] == im_end and c.loss_mask[-1] == 1 for c in conts)  # trained without the option
    from posttrain.data.formats import Row

    pair = TokenizedPair(prompt, conts, Row({}, "pairs.jsonl", 3))
    (masked,) = mask_special([pair], special)
    for before, after in zip(conts, masked.continuations):
        assert after.input_ids == before.input_ids  # the forward still sees the tokens
        assert after.loss_mask == before.loss_mask[:-1] + [0]
        assert after.spans == [(0, len(before.input_ids) - 1)]
    only_template = TokenizedPair(prompt, [conts[0].__class__([im_end], [1], [(0, 1)]), conts[1]], Row({}, "pairs.jsonl", 3))
    with pytest.raises(DataError, match=r"pairs.jsonl:3: chosen: mask_special_tokens=true leaves no trained token"):
        mask_special([only_template], special)


def test_dpo_with_masked_special_tokens_sums_fewer_log_probs(tmp_path):
    """Before the first update the policy is the reference: logps/chosen is Σ log π over the trained tokens. Dropping
    <|im_end|> (log-prob < 0) from every sum makes it strictly larger, and no trained position is a special id."""
    data = write_jsonl(tmp_path / "pairs.jsonl", rule_pairs(16))
    base = ["model=tiny-random", f"data={data}", "batch_size=4", "max_steps=1", "eval_every=0", "length_probe.prompts=0",
            "progress=false", "eval_fraction=0.25"]
    rows = {}
    for flag in ("false", "true"):
        cfg = parse_args(dpo.DPOConfig, [*base, f"output_dir={tmp_path / flag}", f"mask_special_tokens={flag}"])
        run = dpo.setup(cfg)
        rows[flag] = dpo.dpo_step(run, 0)
        if flag == "true":
            special = special_token_ids(run.tok)
            assert all(m == 0 for ex in run.train for c in ex.continuations
                       for t, m in zip(c.input_ids, c.loss_mask) if t in special)
    assert rows["true"]["logps/chosen"] > rows["false"]["logps/chosen"]
    assert rows["true"]["logps/rejected"] > rows["false"]["logps/rejected"]


def test_length_growth_alarm_names_the_length_normalised_losses():
    out = io.StringIO()
    alarms = PreferenceAlarms(max_length_ratio=1.3, stream=out)
    assert alarms.update(4, {"length/ratio": 1.6}) == {"alarm/length_growth": 1}
    text = out.getvalue()
    assert "1.60x the reference's length" in text and "loss=simpo" in text and "loss=dpo_norm" in text


def test_mask_special_tokens_wrong_type_is_refused_by_name():
    from posttrain.config import ConfigError

    with pytest.raises(ConfigError, match="mask_special_tokens: Input should be a valid boolean"):
        parse_args(dpo.DPOConfig, ["mask_special_tokens=sometimes"])
