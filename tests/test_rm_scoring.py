"""A reward model scores the token the ecosystem scores: `AutoModelForSequenceClassification` on the chat
template's rendering (what TRL's RewardTrainer trains on and what a user of an exported RM feeds it) reads
the last non-pad token of `apply_chat_template(prompt + reply)`; in ChatML the newline after `<|im_end|>`.
posttrain's RM training, `reward=rm:`, `rm probe` and `posttrain score` read the same token, for its own RMs
and for a folder saved the way TRL saves one."""

import json

import pytest
import torch

from conftest import write_jsonl
from preference_synthetic import rule_pairs

PROMPT = [{"role": "user", "content": "Say something about rivers."}]
REPLIES = ["Sure green river stone", "No", "Sure music light"]


def hf_scores(folder, tok, prompt, replies) -> list[float]:
    """transformers alone: the template text of each conversation, one sequence per forward (no padding),
    and a right-padded batch; both read the last non-pad token."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    if isinstance(prompt, str):
        texts = [prompt + r + tok.eos_token for r in replies]
        seqs = [tok(t)["input_ids"] for t in texts]
    else:
        texts = [tok.apply_chat_template(prompt + [{"role": "assistant", "content": r}], tokenize=False) for r in replies]
        seqs = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    with torch.no_grad():
        alone = [float(model(input_ids=torch.tensor([s])).logits[0, 0]) for s in seqs]
        pad = model.config.pad_token_id
        width = max(map(len, seqs))
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])  # TRL's collator (pad may be EOS)
        padded = model(input_ids=ids, attention_mask=mask).logits[:, 0].tolist()
    assert padded == pytest.approx(alone, abs=1e-5)
    return alone


@pytest.fixture(scope="module")
def posttrain_rm(tmp_path_factory, tiny_tok):
    """A reward model folder as `posttrain rm` writes final/ (an untrained head: the scoring mechanics)."""
    from posttrain.models.reward_head import load_reward_model

    folder = tmp_path_factory.mktemp("rm") / "final"
    load_reward_model("tiny-random", pad_token_id=tiny_tok.pad_token_id, seed=3).save_pretrained(folder)
    tiny_tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def trl_rm(tmp_path_factory):
    """A folder saved the way TRL's RewardTrainer saves one: a *ForSequenceClassification with num_labels=1,
    a tokenizer without a pad token given the EOS as its pad (TRL's default), config.pad_token_id set to it."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from posttrain.models.builtin import TINY_TOKENIZER, build_tiny

    tok = AutoTokenizer.from_pretrained(TINY_TOKENIZER)
    tok.pad_token = tok.eos_token  # TRL: pad_token = args.pad_token or tokenizer.pad_token or eos_token
    cfg = build_tiny("tiny-random", seed=5).config
    cfg.num_labels, cfg.pad_token_id, cfg.architectures = 1, tok.pad_token_id, None
    torch.manual_seed(5)
    model = AutoModelForSequenceClassification.from_config(cfg)
    folder = tmp_path_factory.mktemp("trl") / "Tiny-Reward"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["architectures"][0].endswith("ForSequenceClassification")
    return folder, tok


def test_the_scored_tokens_are_the_templates_rendering(tiny_tok):
    from posttrain.data.preference import render_scored

    p_ids, conts = render_scored(tiny_tok, PROMPT, REPLIES)
    for reply, c in zip(REPLIES, conts):
        want = tiny_tok.apply_chat_template(PROMPT + [{"role": "assistant", "content": reply}], tokenize=True, return_dict=False)
        assert p_ids + c.input_ids == want
        assert tiny_tok.convert_ids_to_tokens(want[-2:]) == ["<|im_end|>", "Ċ"]  # ChatML ends with <|im_end|> + "\n"
    assert p_ids == tiny_tok.apply_chat_template(PROMPT, tokenize=True, add_generation_prompt=True, return_dict=False)


def test_reward_equals_transformers_on_the_template_text(posttrain_rm, tiny_tok):
    from posttrain.rewards.reward_model import RewardModelScorer

    scorer = RewardModelScorer(str(posttrain_rm), device="cpu")
    want = hf_scores(posttrain_rm, tiny_tok, PROMPT, REPLIES)
    got = scorer([PROMPT] * 3, REPLIES)  # one group: the prompt forward shared
    assert got == pytest.approx(want, abs=1e-4), (got, want)
    # reading <|im_end|> instead (the token before the closing newline) gives other values: the test can tell
    from posttrain.data.preference import render_sequences

    cut = [p + c.input_ids for p, c in [(render_sequences(tiny_tok, PROMPT, [r])[0], render_sequences(tiny_tok, PROMPT, [r])[1][0])
                                        for r in REPLIES]]
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(posttrain_rm).eval()
    with torch.no_grad():
        at_im_end = [float(model(input_ids=torch.tensor([s])).logits[0, 0]) for s in cut]
    assert max(abs(a - b) for a, b in zip(at_im_end, want)) > 1e-3
    # plain-text prompts: prompt + completion + EOS, as TRL's standard format
    got = scorer(["Rivers:"] * 3, REPLIES)
    assert got == pytest.approx(hf_scores(posttrain_rm, tiny_tok, "Rivers:", REPLIES), abs=1e-4)


def test_a_trl_saved_reward_model_scores_the_same_inside_posttrain(trl_rm):
    from posttrain.rewards.registry import compose

    folder, tok = trl_rm
    want = hf_scores(folder, tok, PROMPT, REPLIES)
    reward = compose(f"rm:{folder}", options={f"rm:{folder}": {"device": "cpu"}})
    got = reward([PROMPT] * 3, REPLIES)
    assert got == pytest.approx(want, abs=1e-4), (got, want)
    # pad = EOS = <|im_end|>: the closing newline is the last non-pad token, not the text before <|im_end|>
    assert tok.pad_token_id == tok.eos_token_id == json.loads((folder / "config.json").read_text())["pad_token_id"]


def test_posttrain_score_with_an_rm_equals_transformers(trl_rm, tmp_path):
    from posttrain.rewards import cli

    folder, tok = trl_rm
    rows = [{"prompt": PROMPT, "completion": r} for r in REPLIES]
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    cli.main([f"data={data}", f"reward=rm:{folder}", f"output={out}", f'reward_args={{"rm:{folder}": {{device: cpu}}}}'])
    got = [json.loads(line)["reward"] for line in out.read_text().splitlines()]
    assert got == pytest.approx(hf_scores(folder, tok, PROMPT, REPLIES), abs=1e-4)


def test_rm_training_reads_the_token_transformers_reads(tmp_path):
    """The rewards inside `posttrain rm`'s loss equal transformers' scores of the template text."""
    from posttrain.config import parse_args
    from posttrain.data.prefix_batch import build
    from posttrain.models.reward_head import sequence_rewards
    from posttrain.recipes import rm

    rows = rule_pairs(4)
    data = write_jsonl(tmp_path / "p.jsonl", rows)
    cfg = parse_args(rm.RMConfig, ["model=tiny-random", f"data={data}", f"output_dir={tmp_path / 'run'}", "max_steps=1",
                                   "eval_fraction=0", "progress=false", "device=cpu"])
    run = rm.setup(cfg)
    ex = run.train
    for e, row in zip(ex, rows):
        for c, side in zip(e.continuations, ("chosen", "rejected")):
            want = run.tok.apply_chat_template(row["prompt"] + row[side], tokenize=True, return_dict=False)
            assert e.prompt_ids + c.input_ids == want  # TRL's chosen_ids / rejected_ids
    batch = build([(e.prompt_ids, e.continuations) for e in ex], run.tok.pad_token_id)
    run.model.eval()
    with torch.no_grad():
        r = sequence_rewards(run.model, batch)
    folder = tmp_path / "now"
    run.model.save_pretrained(folder)
    run.tok.save_pretrained(folder)
    for i, row in enumerate(rows):
        replies = [row["chosen"][0]["content"], row["rejected"][0]["content"]]
        assert r[2 * i: 2 * i + 2].tolist() == pytest.approx(hf_scores(folder, run.tok, row["prompt"], replies), abs=1e-4)
