"""`posttrain rm`: the Bradley–Terry reward model learns a rule, saves as a transformers sequence classifier,
and is a reward (`reward=rm:PATH`) in compositions and in RL."""

import json

import pytest
import torch

from conftest import write_jsonl
from posttrain.config import parse_args
from posttrain.recipes import rm
from preference_synthetic import rule_pairs


def train_rm(tmp_path, *overrides, rows=None, name="rm"):
    data = write_jsonl(tmp_path / f"{name}.jsonl", rows or rule_pairs(64))
    cfg = parse_args(rm.RMConfig, ["model=tiny-random", f"data={data}", f"output_dir={tmp_path / name}",
                                   "batch_size=8", "optim.lr=3e-3", "optim.warmup_steps=1", "eval_fraction=0.25",
                                   "eval_every=0", "progress=false", *overrides])
    return rm.train(cfg), tmp_path / name


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_rm(tmp_path_factory.mktemp("rm"), "max_steps=16")


def test_rm_reaches_90_percent_held_out_pairwise_accuracy(trained):
    summary, out = trained
    assert summary["eval/accuracy_after"] >= 0.9, summary  # 16 held-out pairs, chance 0.5
    assert summary["eval/accuracy_before"] < 0.9
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for key in ("loss", "rm/accuracy", "rm/margin", "rm/reward_mean"):
        assert key in rows[0], key
    last = rows[-1]
    assert last["accuracy_gap"] == pytest.approx(last["train_eval/accuracy"] - last["eval/accuracy"])
    for name in ("report.html", "plan.json", "summary.json", "final/config.json"):
        assert (out / name).is_file(), name


def test_final_loads_as_a_sequence_classifier_and_scores_like_the_reward(trained, tiny_tok):
    from transformers import AutoModelForSequenceClassification

    from posttrain.rewards.reward_model import RewardModelScorer

    _, out = trained
    model = AutoModelForSequenceClassification.from_pretrained(out / "final").eval()
    assert model.config.num_labels == 1 and model.config.pad_token_id == tiny_tok.pad_token_id
    prompt = [{"role": "user", "content": "Say something about rivers."}]
    texts = ["Sure green river stone", "No", "Sure music"]
    scorer = RewardModelScorer(str(out / "final"), device="cpu")
    got = scorer([prompt] * 3, texts)
    # transformers on the chat template's text, a right-padded batch: the score is read at each row's last
    # non-pad token (the newline after <|im_end|>); tests/test_rm_scoring.py checks more cases
    seqs = [tiny_tok(tiny_tok.apply_chat_template(prompt + [{"role": "assistant", "content": t}], tokenize=False),
                     add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [tiny_tok.pad_token_id] * (width - len(s)) for s in seqs])
    mask = (ids != tiny_tok.pad_token_id).long()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits[:, 0]
    assert torch.allclose(torch.tensor(got), want, atol=1e-4), (got, want)
    assert got[0] > got[1] and got[2] > got[1]  # the rule: "Sure" beats "No"
    # every sample scored alone gives the same values as the packed, prompt-shared batch
    alone = [scorer([prompt], [t])[0] for t in texts]
    assert alone == pytest.approx(got, abs=1e-4)


def test_rm_reward_in_a_composition_and_refusals(trained, tmp_path):
    from posttrain.errors import UserError
    from posttrain.rewards.registry import compose, parse_spec

    _, out = trained
    ref = f"rm:{out / 'final'}"
    assert parse_spec(f"{ref}:0.5,format") [0] == (ref, 0.5)
    reward = compose(f"{ref}:2.0", options={ref: {"device": "cpu", "batch_tokens": 64}})
    prompt = [{"role": "user", "content": "Say something about rivers."}]
    single = compose(ref)([prompt], ["Sure stone"])[0]
    assert reward([prompt], ["Sure stone"])[0] == pytest.approx(2 * single, abs=1e-4)
    assert f"rewards/{ref}/mean" in reward.last_metrics
    with pytest.raises(UserError, match="not found"):
        compose(f"rm:{tmp_path / 'nothing'}")
    with pytest.raises(UserError, match="not a reward model"):
        compose(f"rm:{tmp_path}")


def test_margin_column_and_centering(tmp_path):
    rows = [dict(r, margin=3.0) for r in rule_pairs(16)]
    data = write_jsonl(tmp_path / "m.jsonl", rows)
    cfg = parse_args(rm.RMConfig, ["model=tiny-random", f"data={data}", f"output_dir={tmp_path / 'run'}", "max_steps=1",
                                   "eval_fraction=0", "progress=false"])
    run = rm.setup(cfg)
    from posttrain.data.prefix_batch import build

    ex = run.train[:4]
    batch = build([(e.prompt_ids, e.continuations) for e in ex], run.tok.pad_token_id)
    from posttrain.models.reward_head import sequence_rewards

    with torch.no_grad():
        r = sequence_rewards(run.model, batch)
        with_margin, _ = rm.pair_loss(run, batch, ex)
        run.cfg.use_margin = False
        plain, _ = rm.pair_loss(run, batch, ex)
        run.cfg.center_coef = 0.5
        centered, _ = rm.pair_loss(run, batch, ex)
    F = torch.nn.functional
    assert torch.allclose(with_margin, -F.logsigmoid(r[0::2] - r[1::2] - 3.0))  # Llama 2: −log σ(r_w − r_l − m)
    assert torch.allclose(plain, -F.logsigmoid(r[0::2] - r[1::2]))
    assert torch.allclose(centered, plain + 0.5 * (r[0::2] + r[1::2]) ** 2)


def test_rm_reward_drives_rl(trained, tmp_path):
    from posttrain.recipes import rl

    _, out = trained
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": r["prompt"]} for r in rule_pairs(4)])
    cfg = parse_args(rl.RLConfig, ["model=tiny-random", f"data={prompts}", f"output_dir={tmp_path / 'rl'}",
                                   f"reward=rm:{out / 'final'}", "prompts_per_step=2", "group_size=2",
                                   "max_new_tokens=4", "max_steps=1", "progress=false"])
    rl.train(cfg)
    row = json.loads((tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["reward/std"] > 0 and f"rewards/rm:{out / 'final'}/mean" in row
