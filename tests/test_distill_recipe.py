"""posttrain distill on tiny models: each mode against a hand-worked two-token example, the top-k teacher
cache (exact coarsened KL, read not recomputed, reused across runs, its size), the tokenizer refusal, plan.json."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import write_jsonl

PROMPTS = [{"prompt": [{"role": "user", "content": f"Count to {d}, please."}], "answer": str(d)} for d in range(1, 5)]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A tiny teacher folder: tiny-random's architecture and tokenizer, other weights (seed 1)."""
    from posttrain.models.builtin import build_tiny
    from posttrain.models.loading import load_tokenizer

    path = tmp_path_factory.mktemp("teacher")
    build_tiny("tiny-random", seed=1).save_pretrained(path)
    load_tokenizer("tiny-random").save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def other_tokenizer_teacher(tmp_path_factory, teacher_dir):
    """The same teacher with ids 300 and 301 swapped in its tokenizer: a different tokenizer, same size."""
    import shutil

    path = tmp_path_factory.mktemp("teacher_other_tok")
    shutil.copytree(teacher_dir, path, dirs_exist_ok=True)
    spec = json.loads((path / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = (next(t for t, i in vocab.items() if i == j) for j in (300, 301))
    vocab[a], vocab[b] = 301, 300
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return str(path), a, b


def config(tmp_path, teacher, *args):
    from posttrain.config import parse_args
    from posttrain.recipes.distill import DistillConfig

    return parse_args(DistillConfig, [f"teacher={teacher}", "progress=false", *args])


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def plain_logprobs(model, ids):
    """log-softmax (T, V) of a plain HF forward over one sequence (no packing, no layout)."""
    with torch.no_grad():
        return F.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)


# ---------------------------------------------------------------- logit mode


def test_logit_two_token_example_by_hand():
    # two loss tokens, V = 3, k = 1. Position 1: P = (.5, .3, .2) -> P̄ = (.5 | .5), Q = (.2, .6, .2) -> Q̄ = (.2 | .8).
    # Position 2: P = (.1, .7, .2) -> top-1 is id 1: P̄ = (.7 | .3), Q = (.25, .5, .25) -> Q̄ = (.5 | .5).
    from posttrain.recipes.distill.cache import topk_with_tail
    from posttrain.recipes.distill.config import DistillConfig
    from posttrain.recipes.distill.logit import logit_token_losses

    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.7, 0.2]])
    q = torch.tensor([[0.2, 0.6, 0.2], [0.25, 0.5, 0.25]])
    ids, top, tail = topk_with_tail(p.log(), 1, 1.0)
    assert ids.tolist() == [[0], [1]]
    targets = torch.tensor([1, 1])
    kl = lambda a, b: sum(x * math.log(x / y) for x, y in zip(a, b))
    expected = {"forward_kl": [kl((.5, .5), (.2, .8)), kl((.7, .3), (.5, .5))],
                "reverse_kl": [kl((.2, .8), (.5, .5)), kl((.5, .5), (.7, .3))]}
    for name, want in expected.items():
        cfg = DistillConfig(mode="logit", teacher="t", divergence=name)
        d, nll = logit_token_losses(cfg, q.log(), targets, ids, top, tail)
        torch.testing.assert_close(d, torch.tensor(want), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(nll, torch.tensor([-math.log(0.6), -math.log(0.5)]))


def test_cache_rows_are_the_teachers_coarsened_distribution(tmp_path, teacher_dir, tiny_tok):
    # fp32 cache: the stored top-k log-probs and tail equal the teacher's full distribution coarsened, and the
    # KL read from the cache equals the KL of the coarsened distributions computed from full logits.
    from posttrain.data.templates import render_row
    from posttrain.models.loading import load_model
    from posttrain.recipes.distill import cache as distill_cache

    samples = [render_row(tiny_tok, {"messages": [{"role": "user", "content": f"hi {i}"},
                                                  {"role": "assistant", "content": f"a reply number {i}"}]}, "conversation")
               for i in range(3)]
    teacher = load_model(teacher_dir)
    cache, n, _ = distill_cache.build(tmp_path / "c", teacher, samples, k=8, temperature=1.0, value_dtype="float32",
                                      vocab=1024, pad_id=tiny_tok.pad_token_id, mixed_precision="none", token_budget=40,
                                      device="cpu")
    assert n == sum(sum(s.loss_mask[1:]) for s in samples) == cache.meta["tokens"]
    assert cache.bytes_on_disk == n * (8 * (2 + 4) + 4)  # uint16 ids, float32 values + the tail
    student = load_model("tiny-random")
    for i, s in enumerate(samples):
        ids, top, tail = cache.read(cache.rows_of([i]), "cpu")
        pos = [t for t in range(len(s) - 1) if s.loss_mask[t + 1]]
        lp_t = plain_logprobs(teacher, s.input_ids)[pos]
        torch.testing.assert_close(top, lp_t.gather(1, ids), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(tail.exp(), 1 - top.exp().sum(-1), atol=1e-5, rtol=1e-5)
        q = plain_logprobs(student, s.input_ids)[pos].exp()
        p_bar = torch.cat([lp_t.exp().gather(1, ids), tail.exp()[:, None]], 1)
        q_bar = torch.cat([q.gather(1, ids), 1 - q.gather(1, ids).sum(1, keepdim=True)], 1)
        want = (p_bar * (p_bar / q_bar).log()).sum(1)
        from posttrain.algos import distill_losses

        got, _ = distill_losses.get("forward_kl")(q.log()[None], torch.ones(1, len(pos)), teacher_topk_logps=top[None],
                                                  teacher_topk_ids=ids[None], teacher_tail_logp=tail[None])
        torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-4)
    assert cache.read_tokens == n


def test_logit_cache_is_read_not_recomputed_and_reused_by_a_second_run(tmp_path, teacher_dir, monkeypatch, capsys):
    from posttrain.recipes import distill

    data = "arithmetic:6"
    args = [f"data={data}", "mode=logit", "packing=false", "batch_size=3", "micro_batch_size=2", "max_steps=4",
            "optim.lr=1e-3", "top_k=16"]
    s1 = distill.train(config(tmp_path, teacher_dir, *args, f"output_dir={tmp_path / 'a'}"))
    n = s1["cache"]["tokens"]
    r = rows(tmp_path / "a")
    # 4 steps x 3 samples = 2 epochs over the 6 samples: the teacher scored each loss token once, the cache was read twice
    assert [x["epoch"] for x in r] == [0, 0, 1, 1]
    assert all(x["cache/teacher_tokens"] == n for x in r)
    assert r[-1]["cache/read_tokens"] == 2 * n == sum(x["loss_tokens"] for x in r)
    assert s1["cache"]["built"] is True and s1["last_kd"] < s1["first_kd"]
    printed = capsys.readouterr().out
    assert f"{n:,} tokens x 66 B = top-16 x (2 B id + 2 B log-prob) + 2 B tail" in printed  # 16 x 4 + 2
    assert s1["cache"]["bytes"] == n * 66
    plan = json.loads((tmp_path / "a" / "plan.json").read_text())
    assert plan["predicted"]["teacher"]["cache_bytes"] == plan["measured"]["teacher"]["cache_bytes"] == n * 66
    assert plan["predicted"]["distill"]["cache_bytes_per_token"] == 66
    assert plan["comparison"]["teacher_tokens_over_predicted"] == 1.0
    assert plan["comparison"]["tokens_over_data_plan"] == 1.0
    # a second run next to the first: the teacher is never loaded, the cache rows are read
    from posttrain.models import loading

    real = loading.load_model

    def student_only(name, *a, **kw):
        assert name != teacher_dir, "the teacher was loaded although its cache exists"
        return real(name, *a, **kw)

    monkeypatch.setattr(loading, "load_model", student_only)
    s2 = distill.train(config(tmp_path, teacher_dir, *args, f"output_dir={tmp_path / 'b'}"))
    assert s2["cache"]["built"] is False and s2["cache"]["path"] == s1["cache"]["path"]
    assert all(x["cache/teacher_tokens"] == 0 for x in rows(tmp_path / "b"))
    assert s2["first_kd"] == pytest.approx(s1["first_kd"], rel=1e-6)  # same rows, same numbers


def test_logit_step_loss_equals_the_coarsened_kl_of_a_plain_forward(tmp_path, teacher_dir, tiny_tok):
    # one step, one sample, fp32 cache: the logged divergence is the token mean of KL(P̄ ‖ Q̄) over the loss tokens,
    # P̄ and Q̄ from plain forwards of the two models before the update
    from posttrain.data import formats
    from posttrain.models.loading import load_model
    from posttrain.recipes import distill
    from posttrain.recipes.sft import tokenize_rows

    data = write_jsonl(tmp_path / "one.jsonl", [{"messages": [{"role": "user", "content": "Say hi"},
                                                               {"role": "assistant", "content": "hi there, friend"}]}])
    cfg = config(tmp_path, teacher_dir, f"data={data}", "mode=logit", "max_steps=1", "batch_size=1", "top_k=5",
                 "cache_dtype=float32", f"output_dir={tmp_path / 'run'}", "ce_weight=0.25")
    row = distill.train(cfg) and rows(tmp_path / "run")[0]
    (sample,) = tokenize_rows(tiny_tok, formats.load(data)[0], "conversation", distill.sft_settings(cfg))
    pos = [t for t in range(len(sample) - 1) if sample.loss_mask[t + 1]]
    lp, lq = plain_logprobs(load_model(teacher_dir), sample.input_ids)[pos], plain_logprobs(load_model("tiny-random"), sample.input_ids)[pos]
    ids = lp.topk(5, -1).indices
    p_bar = torch.cat([lp.exp().gather(1, ids), 1 - lp.exp().gather(1, ids).sum(1, keepdim=True)], 1)
    q_bar = torch.cat([lq.exp().gather(1, ids), 1 - lq.exp().gather(1, ids).sum(1, keepdim=True)], 1)
    kd = float((p_bar * (p_bar / q_bar).log()).sum(1).mean())
    nll = float(-lq.gather(1, torch.tensor([sample.input_ids[t + 1] for t in pos])[:, None]).mean())
    assert row["distill/kd"] == pytest.approx(kd, rel=1e-4)
    assert row["distill/nll"] == pytest.approx(nll, rel=1e-5)
    assert row["loss"] == pytest.approx(0.75 * kd + 0.25 * nll, rel=1e-4)


# ---------------------------------------------------------------- on-policy mode


def onpolicy_run(tmp_path, teacher, *args):
    from posttrain.recipes.distill import on_policy

    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    return on_policy.setup(config(tmp_path, teacher, f"data={data}", "mode=on_policy", "prompts_per_step=1",
                                         "group_size=2", "max_new_tokens=4", f"output_dir={tmp_path / 'op'}", *args))


def test_on_policy_two_token_example_by_hand(tmp_path, teacher_dir, monkeypatch):
    # The student "samples" two fixed completions of one prompt: 2 tokens (reward 1) and 1 token (reward 0).
    # Per token t: D_t = KL(Q_t ‖ P_t) over the full vocabulary from plain forwards before the update;
    # loss = (1 − w)·mean_t D_t + w·L_RL, RLOO: A = (+1, −1), ratio 1, token mean: L_RL = −(2·1 + 1·(−1))/3 = −1/3.
    from posttrain.recipes.distill import on_policy
    from posttrain.rollout.trajectory import Trajectory

    run = onpolicy_run(tmp_path, teacher_dir, "reward=math", "rl_weight=0.5", "algo=rloo")
    from posttrain.data.templates import render_prompt

    prompt = render_prompt(run.rl.tok, PROMPTS[0]["prompt"])
    responses, rewards = [[17, 42], [99]], [1.0, 0.0]
    trajs = [Trajectory(prompt, resp, torch.zeros(len(resp)), 0, reward=rwd) for resp, rwd in zip(responses, rewards)]
    monkeypatch.setattr(run.rl.rollout, "collect", lambda r, step: (trajs, {}))
    student_before = {k: v.clone() for k, v in run.rl.model.state_dict().items()}
    d = []
    for resp in responses:
        ids = prompt + resp
        lq = plain_logprobs(run.rl.model, ids)[len(prompt) - 1 : len(ids) - 1]
        lp = plain_logprobs(run.teacher, ids)[len(prompt) - 1 : len(ids) - 1]
        d += (lq.exp() * (lq - lp)).sum(-1).tolist()
    row = on_policy.distill_step(run, 0)
    assert row["distill/loss"] == pytest.approx(sum(d) / 3, rel=1e-5)
    assert row["loss"] == pytest.approx(0.5 * sum(d) / 3 + 0.5 * (-1 / 3), rel=1e-5)
    assert row["teacher/tokens"] == 3
    moved = any(not torch.equal(v, run.rl.model.state_dict()[k]) for k, v in student_before.items())
    assert moved


def test_on_policy_run_lowers_the_divergence_and_plans_the_teachers_tokens(tmp_path, teacher_dir):
    from posttrain.recipes import distill

    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    out = tmp_path / "run"
    s = distill.train(config(tmp_path, teacher_dir, f"data={data}", "mode=on_policy", "prompts_per_step=2",
                             "group_size=2", "max_new_tokens=6", "ignore_eos=true", "optim.lr=1e-2", "max_steps=4",
                             "divergence=jsd", "beta=0.5", f"output_dir={out}"))
    r = rows(out)
    assert r[-1]["distill/loss"] < r[0]["distill/loss"] and s["divergence"] == "jsd"
    plan = json.loads((out / "plan.json").read_text())
    assert [m["role"] for m in plan["predicted"]["models"]] == ["policy", "teacher"]
    # every sample runs to max_new_tokens: the teacher scores exactly the predicted tokens; tokens per step exact
    assert plan["measured"]["teacher"]["scored_tokens"] == 4 * 2 * 2 * 6
    assert plan["comparison"]["teacher_tokens_over_predicted"] == 1.0
    assert plan["comparison"]["tokens_per_step_over_predicted"] == 1.0
    assert plan["predicted"]["teacher"]["share_of_step_flops"] == pytest.approx(2 / 10)  # 2N_T of 2N + 2N_T + 6N
    assert (out / "final" / "config.json").is_file()
    assert json.loads((out / "summary.json").read_text())["mode"] == "on_policy"


# ---------------------------------------------------------------- sequence mode


def test_sequence_mode_is_sft_on_the_teachers_text(tmp_path, other_tokenizer_teacher, tiny_tok):
    # across tokenizers (text is what passes); the student's first SFT loss is its NLL on the teacher's completions
    from posttrain.data import formats
    from posttrain.models.loading import load_model
    from posttrain.recipes import distill
    from posttrain.recipes.sft import tokenize_rows

    teacher, _, _ = other_tokenizer_teacher
    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS[:2])
    out = tmp_path / "seq"
    cfg = config(tmp_path, teacher, f"data={data}", "mode=sequence", "n=1", "max_new_tokens=2", "ignore_eos=true",
                 "keep_truncated=true", "max_steps=1", "batch_size=8", f"output_dir={out}")
    s = distill.train(cfg)
    kept = formats.load(out / "teacher" / "kept.jsonl")[0]
    assert len(kept) == s["kept_rows"] == 2
    samples = tokenize_rows(tiny_tok, kept, "conversation", distill.sft_settings(cfg))
    student = load_model("tiny-random")
    nll, count = 0.0, 0
    for smp in samples:
        pos = [t for t in range(len(smp) - 1) if smp.loss_mask[t + 1]]
        lq = plain_logprobs(student, smp.input_ids)[pos]
        nll -= float(lq.gather(1, torch.tensor([smp.input_ids[t + 1] for t in pos])[:, None]).sum())
        count += len(pos)
    assert s["first_loss"] == pytest.approx(nll / count, rel=1e-5)
    assert (out / "sft" / "final" / "config.json").is_file()
    assert json.loads((out / "plan.json").read_text())["predicted"]["distill"]["mode"] == "sequence"


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("mode", ["logit", "on_policy"])
def test_tokenizer_mismatch_is_refused_before_any_model_loads(tmp_path, other_tokenizer_teacher, monkeypatch, mode):
    from posttrain.errors import UserError
    from posttrain.models import loading
    from posttrain.recipes import distill, rl

    teacher, a, b = other_tokenizer_teacher

    def no_model(*a, **k):
        raise AssertionError("a model was loaded before the tokenizer check")

    monkeypatch.setattr(loading, "load_model", no_model)
    monkeypatch.setattr(rl.build, "load_model", no_model)
    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS) if mode == "on_policy" else "arithmetic:4"
    with pytest.raises(UserError) as e:
        distill.train(config(tmp_path, teacher, f"data={data}", f"mode={mode}", f"output_dir={tmp_path / 'x'}"))
    assert f"token id 300 is {a!r} for the student and {b!r} for the teacher" in str(e.value)
    assert "mode=sequence" in str(e.value)
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


def test_config_refusals(tmp_path):
    from posttrain.config import ConfigError

    for args, msg in [([], "teacher"), (["teacher=t", "mode=logit", "rl_weight=0.5"], "rl_weight applies to mode=on_policy"),
                      (["teacher=t", "top_k=8"], "top_k applies to mode=logit"),
                      (["teacher=t", "rl_weight=0.5"], "needs a reward"),
                      (["teacher=t", "algo=grpx"], "unknown algo"),
                      (["teacher=t", "divergence=kl"], "unknown distillation"),
                      (["teacher=t", "mode=sequence", "keep=best"], "ranks teacher samples by a reward"),
                      (["teacher=t", "mode=sequence", "divergence=jsd"], "no divergence")]:
        with pytest.raises((ConfigError, ValueError), match=msg):
            from posttrain.config import parse_args
            from posttrain.recipes.distill import DistillConfig

            parse_args(DistillConfig, args)


def test_cli_lists_distill_and_plan_takes_mode(capsys):
    from posttrain import cli
    from posttrain.plan import predict

    with pytest.raises(SystemExit):
        cli.main(["distill", "--help"])
    assert "top_k (int) = 64" in capsys.readouterr().out and "distill" in cli.usage()
    p = predict("smollm2-135m", "distill", mode="logit", data_tokens=1000)["distill"]
    assert p["cache_bytes_per_token"] == 64 * 4 + 2 and p["cache_bytes"] == 258 * 1000
    assert predict(8e9, "distill", mode="sequence")["options"]["distill"] == "sequence"
    from posttrain.errors import UserError

    with pytest.raises(UserError, match="disagree"):
        predict(8e9, "distill", mode="logit", distill="sequence")


# ---------------------------------------------------------------- the configs distillation derives


def test_a_field_added_to_both_configs_reaches_the_derived_config(monkeypatch):
    # sft_settings, rl_settings and rs_settings copy every field the configs share (training/settings.py):
    # a field added to DistillConfig and to the recipe's config needs no key list to reach the derived config
    from posttrain.recipes import rl, rs
    from posttrain.recipes.distill import config as distill_config
    from posttrain.recipes.distill import on_policy, sequence

    class DistillPlus(distill_config.DistillConfig):
        new_knob: int = 0

    class SFTPlus(distill_config.SFTConfig):
        new_knob: int = 0

    class RLPlus(rl.RLConfig):
        new_knob: int = 0

    class RSPlus(rs.RSConfig):
        new_knob: int = 0

    class RSTrainPlus(rs.RSTrainSettings):
        new_knob: int = 0

    monkeypatch.setattr(distill_config, "SFTConfig", SFTPlus)
    monkeypatch.setattr(rl, "RLConfig", RLPlus)
    monkeypatch.setattr(rs, "RSConfig", RSPlus)
    monkeypatch.setattr(rs, "RSTrainSettings", RSTrainPlus)
    cfg = DistillPlus(teacher="t", new_knob=7)
    assert distill_config.sft_settings(cfg).new_knob == 7
    assert on_policy.rl_settings(cfg).new_knob == 7
    seq = sequence.rs_settings(cfg.model_copy(update={"mode": "sequence"}))
    assert seq.new_knob == 7 and seq.train.new_knob == 7


def test_derived_configs_hold_every_shared_value():
    # non-default values of every field distillation shares with SFT and RL arrive unchanged (but the keys
    # the derivation sets itself: RL's beta is the KL coefficient, distillation's is JSD's)
    from posttrain.config import parse_args
    from posttrain.recipes.distill import DistillConfig, on_policy, sft_settings

    common = ["teacher=t", "model=m", "data=d.jsonl", "max_steps=7", "seed=3", "dtype=bfloat16", "logit_chunk=33",
              "optim.lr=0.5", "save_every=3", "progress=false", "report_to=tensorboard"]
    # (a key of another mode is refused, so each derivation reads the config of its own mode)
    logit = parse_args(DistillConfig, [*common, "mode=logit", "batch_size=5", "max_length=99"])
    onp = parse_args(DistillConfig, [*common, "prompts_per_step=3", "group_size=5", "max_new_tokens=9",
                                     "reward_args={math: {}}", "mask_truncated=true"])
    # (`epochs` is rejection sampling's in distillation, over the kept rows: the SFT config does not take it)
    for derived, own, cfg in ((sft_settings(logit), {"eval_fraction", "forgetting_probe", "sample_every", "epochs"}, logit),
                              (on_policy.rl_settings(onp), {"reward", "beta", "dynamic_sampling"}, onp)):
        shared = set(type(derived).model_fields) & set(DistillConfig.model_fields)
        assert shared - own, shared
        for k in shared - own:
            assert getattr(derived, k) == getattr(cfg, k), k
