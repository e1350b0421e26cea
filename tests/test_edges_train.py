"""Fuzz cases for `posttrain rm`, `rm probe`, `dpo` (kto, orpo, simpo), `distill` (logit | sequence | on_policy),
`rs`, `plan`, `methods`, `models` (tests/edges.py: each case works or stops with one clear line)."""

import json

import pytest

from edges import ERROR, FILES, WORKS, Case, classify, ids, jsonl_file, write_file
from posttrain.config import parse_args, save_yaml

pytestmark = pytest.mark.usefixtures("no_activation_probe")  # tests/conftest.py

SHORT = ["batch_size=1", "micro_batch_size=1", "max_length=64", "pad_to_multiple_of=8"]  # one short row a step
RM = ["rm", "model=tiny-random", "data={pref}", "output_dir={tmp}/out", "max_steps=1"]
# the length probe samples 8 x 256 tokens at each eval: 4 tokens in dpo-works, off in the other dpo cases
DPO = ["dpo", "model=tiny-random", "data={pref}", "output_dir={tmp}/out", "max_steps=1", "length_probe.prompts=0",
       "pad_to_multiple_of=8"]
DISTILL = ["distill", "model=tiny-random", "teacher=tiny-random", "output_dir={tmp}/out", "max_steps=1"]
LOGIT = [*DISTILL, "mode=logit", "data={sft}", *SHORT]
SEQ = [*DISTILL, "mode=sequence", "data={prompts}", "max_new_tokens=4", "n=1", *SHORT]
ONP = [*DISTILL, "mode=on_policy", "data={prompts}", "max_new_tokens=4", "prompts_per_step=2", "group_size=2"]
RS = ["rs", "model=tiny-random", "data={prompts}", "reward=math", "n=2", "max_new_tokens=4", "output_dir={tmp}/out",
      "train.max_steps=1", *(f"train.{a}" for a in SHORT)]
RL = ["rl", "model=tiny-random", "data={prompts}", "reward=math", "output_dir={tmp}/out", "max_steps=1",
      "prompts_per_step=2", "group_size=2", "max_new_tokens=4"]
PROBE = ["rm", "probe", "rm={run:rm}/final", "data={pref}", "output_dir={tmp}/probe"]


def _summary(run, rel="out/summary.json") -> dict:
    return run.json(rel)


def _final(run):
    assert (run.tmp / "out" / "final" / "config.json").is_file() or (run.tmp / "out" / "final" / "adapter_config.json").is_file()


def _steps(n):
    def check(run):
        rows = [json.loads(line) for line in (run.tmp / "out" / "metrics.jsonl").read_text().splitlines() if line.strip()]
        assert [r["step"] for r in rows if "loss" in r][-1:] == ([n] if n else []), rows
    return check




def _pairs(n):
    return [{"prompt": f"What is {i} + 1?", "chosen": f"{i + 1}", "rejected": f"maybe {i + 7}"} for i in range(n)]


def _unpaired(n):
    return [{"prompt": f"What is {i} + 1?", "completion": f"{i + 1}" if i % 2 else f"{i + 5}", "label": bool(i % 2)}
            for i in range(n)]


def _parquet(name, rows):
    def setup(tmp):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), tmp / name)
    return setup


def _own_config(cls_path, argv, rows):
    """The config.yaml a run of `argv` writes (setup_run: save_yaml of the parsed config), in {tmp}/run/, with its
    data `rows` in {tmp}/d.jsonl."""
    def setup(tmp):
        module, name = cls_path.rsplit(":", 1)
        cls = getattr(__import__(module, fromlist=[name]), name)
        (tmp / "run").mkdir()
        (tmp / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        save_yaml(parse_args(cls, [*argv, f"data={tmp}/d.jsonl"]), tmp / "run" / "config.yaml")
    return setup


def _lora_adapter(base):
    """A LoRA adapter folder of tiny-random (a LoRA run's final/adapter/) whose adapter_config.json names `base`
    (None: as a tiny-random run writes it, no base)."""
    def setup(tmp):
        from posttrain.models.loading import load_model, load_tokenizer
        from posttrain.models.lora import LoraSettings, apply_lora

        model = apply_lora(load_model("tiny-random"), LoraSettings(enabled=True, r=2))
        model.save_pretrained(tmp / "adapter")
        load_tokenizer("tiny-random").save_pretrained(tmp / "adapter")
        cfg = json.loads((tmp / "adapter" / "adapter_config.json").read_text())
        cfg["base_model_name_or_path"] = base and base.replace("{tmp}", str(tmp))
        (tmp / "adapter" / "adapter_config.json").write_text(json.dumps(cfg))
    return setup


def _policy_folder(tmp):
    from posttrain.models.loading import load_model, load_tokenizer

    load_model("tiny-random").save_pretrained(tmp / "policy")
    load_tokenizer("tiny-random").save_pretrained(tmp / "policy")


def _printed(*words):
    def check(run):
        for w in words:
            assert w in run.out, f"{w!r} not in stdout:\n{run.out[-2000:]}"
    return check


def _only_grpo(run):
    rows = [line.split()[0] for line in run.out.splitlines()[2:] if line.strip() and not line.startswith(" ")]
    assert rows[0] == "grpo" and "sft" not in rows, run.out


CASES = [
    # ------------------------------------------------------------------ rm
    Case("rm-works", RM, WORKS, check=_final),
    Case("rm-no-data", ["rm", "model=tiny-random", "output_dir={tmp}/out"], ERROR, mentions=("data=", "chosen")),
    Case("rm-empty-data", [*RM[:2], "data={empty}", *RM[3:]], ERROR, mentions=("empty.jsonl",)),
    Case("rm-one-pair", [*RM[:2], "data={tmp}/one.jsonl", *RM[3:]], WORKS, setup=jsonl_file("one.jsonl", _pairs(1)),
         check=_final),
    Case("rm-sft-data", [*RM[:2], "data={sft}", *RM[3:]], ERROR, mentions=("sft.jsonl", "chosen")),
    Case("rm-batch-larger-than-data", [*RM, "batch_size=64"], WORKS, check=_final),
    Case("rm-max-steps-0", [*RM[:-1], "max_steps=0"], WORKS),
    Case("rm-max-length-tiny", [*RM, "max_length=8"], ERROR, mentions=("max_length",)),
    Case("rm-max-length-tiny-drop", [*RM, "max_length=8", "too_long=drop"], ERROR, mentions=("max_length",)),
    Case("rm-lr-zero", [*RM, "optim.lr=0"], ERROR, mentions=("optim.lr",)),
    Case("rm-betas-out-of-range", [*RM, "optim.betas=[1.5, 2]"], ERROR, mentions=("optim.betas",)),
    Case("rm-lora-unknown-target", [*RM, "lora.enabled=true", "lora.target_modules=qq_proj"], ERROR,
         mentions=("lora.target_modules", "qq_proj")),
    Case("rm-json-array", [*RM[:2], "data={tmp}/pairs.json", *RM[3:-1], "max_steps=0"], WORKS,
         setup=write_file("pairs.json", json.dumps(_pairs(4))), check=_final),
    Case("rm-parquet", [*RM[:2], "data={tmp}/pairs.parquet", *RM[3:-1], "max_steps=0"], WORKS, setup=_parquet("pairs.parquet", _pairs(4)),
         check=_final),
    Case("rm-chosen-not-text", [*RM[:2], "data={tmp}/bad.jsonl", *RM[3:]], ERROR,
         setup=jsonl_file("bad.jsonl", [*_pairs(2), {"prompt": "x", "chosen": 3, "rejected": "y"}]),
         mentions=("bad.jsonl:3", "chosen")),
    Case("rm-unicode", [*RM[:2], "data={tmp}/u.jsonl", *RM[3:-1], "max_steps=0"], WORKS,
         setup=jsonl_file("u.jsonl", [{"prompt": "Combien font 2 + 2 ? 🤔", "chosen": "4 ✓ — quatre", "rejected": "五"}] * 3),
         check=_final),
    # ------------------------------------------------------------------ rm probe
    Case("rm-probe-works", PROBE, WORKS, check=lambda run: run.json("probe/probe.json")),
    Case("rm-probe-no-data", ["rm", "probe", "rm={run:rm}/final", "output_dir={tmp}/probe"], ERROR,
         mentions=("data=",)),
    Case("rm-probe-missing-rm", ["rm", "probe", "rm={tmp}/nope", "data={pref}", "output_dir={tmp}/probe"], ERROR,
         mentions=("nope",)),
    Case("rm-probe-rm-is-policy", ["rm", "probe", "rm={tmp}/policy", "data={pref}", "output_dir={tmp}/probe"], ERROR,
         setup=_policy_folder, mentions=("policy", "reward model")),
    # ------------------------------------------------------------------ dpo family
    Case("dpo-works", [*DPO[:-1], "length_probe.max_new_tokens=4"], WORKS, check=_final),
    Case("dpo-no-data", ["dpo", "model=tiny-random", "output_dir={tmp}/out"], ERROR, mentions=("data=", "chosen")),
    Case("dpo-unknown-loss", [*DPO, "loss=dpoo"], ERROR, mentions=("dpoo",)),
    Case("dpo-orpo", [*DPO, "loss=orpo"], WORKS, check=_final),
    Case("dpo-simpo", [*DPO, "loss=simpo"], WORKS, check=_final),
    Case("dpo-kto-unpaired", [*DPO[:2], "data={tmp}/kto.jsonl", *DPO[3:], "loss=kto", "batch_size=4"], WORKS,
         setup=jsonl_file("kto.jsonl", _unpaired(6)), check=_final),
    Case("dpo-kto-paired", [*DPO, "loss=kto", "batch_size=4"], WORKS, check=_final),
    Case("dpo-kto-batch-1", [*DPO, "loss=kto", "batch_size=1"], ERROR, mentions=("batch_size",)),
    Case("dpo-beta-zero", [*DPO, "beta=0"], ERROR, mentions=("beta",)),
    Case("dpo-beta-inf", [*DPO, "beta=.inf"], ERROR, mentions=("beta", "finite")),
    Case("dpo-loss-args-unknown", [*DPO, "loss_args={gama: 1}"], ERROR, mentions=("gama",)),
    Case("dpo-one-pair", [*DPO[:2], "data={tmp}/one.jsonl", *DPO[3:]], WORKS, setup=jsonl_file("one.jsonl", _pairs(1)),
         check=_final),
    Case("dpo-identical-chosen-rejected", [*DPO[:2], "data={tmp}/same.jsonl", *DPO[3:]], ERROR,
         setup=jsonl_file("same.jsonl", [{"prompt": "p", "chosen": "same", "rejected": "same"}] * 3),
         mentions=("same.jsonl", "chosen")),
    Case("dpo-missing-rejected", [*DPO[:2], "data={tmp}/m.jsonl", *DPO[3:]], ERROR,
         setup=jsonl_file("m.jsonl", [*_pairs(2), {"prompt": "p", "chosen": "c"}]), mentions=("m.jsonl:3", "rejected")),
    Case("dpo-epochs-and-steps-disagree", [*DPO, "epochs=3"], ERROR, mentions=("epochs", "max_steps")),
    Case("dpo-save-every-above-max-steps", [*DPO, "save_every=50", "eval_every=50"], WORKS, check=_final),
    Case("dpo-modules-to-save-unknown", [*DPO, "lora.enabled=true", "lora.modules_to_save=[foo]"], ERROR,
         mentions=("lora.modules_to_save", "foo")),
    Case("dpo-folder-not-dataset", [*DPO[:2], "data={tmp}", *DPO[3:]], ERROR, mentions=("datasets folder",)),
    # ------------------------------------------------------------------ distill
    Case("distill-logit-works", LOGIT, WORKS, check=_final),
    Case("distill-logit-top-k-above-vocab", [*LOGIT, "top_k=100000"], ERROR, mentions=("top_k", "vocabulary")),
    Case("distill-logit-reward-ignored", [*LOGIT, "reward=math"], ERROR, mentions=("reward", "logit")),
    Case("distill-logit-sampling-ignored", [*LOGIT, "max_new_tokens=8"], ERROR, mentions=("sampling", "logit")),
    Case("distill-logit-n-other-mode", [*LOGIT, "n=4"], ERROR, mentions=("n", "mode=sequence")),
    Case("distill-no-teacher", ["distill", "model=tiny-random", "mode=logit", "data={sft}", "output_dir={tmp}/out"],
         ERROR, mentions=("teacher",)),
    Case("distill-teacher-typo", [*LOGIT[:2], "teacher={tmp}/teachr", *LOGIT[3:]], ERROR, mentions=("teachr",)),
    Case("distill-unknown-divergence", [*LOGIT, "divergence=kl"], ERROR, mentions=("divergence",)),
    Case("distill-jsd-beta-1", [*LOGIT, "divergence=jsd", "beta=1"], ERROR, mentions=("beta",)),
    Case("distill-sequence-works", [*SEQ, "keep_truncated=true"], WORKS,
         check=lambda run: (run.tmp / "out" / "sft" / "final" / "config.json").is_file()),
    Case("distill-sequence-all-cut", SEQ, ERROR, mentions=("max_new_tokens=4", "keep_truncated")),
    Case("distill-sequence-divergence", [*SEQ, "divergence=jsd"], ERROR, mentions=("divergence", "sequence")),
    Case("distill-on-policy-works", ONP, WORKS, check=_final),
    Case("distill-on-policy-greedy", [*ONP, "temperature=0"], ERROR, mentions=("temperature",)),
    Case("distill-on-policy-rl-weight-no-reward", [*ONP, "rl_weight=0.5"], ERROR, mentions=("rl_weight", "reward")),
    Case("distill-own-config", ["distill", "--config", "{tmp}/run/config.yaml", "max_steps=1",
                                "output_dir={tmp}/again"], WORKS,
         setup=_own_config("posttrain.recipes.distill.config:DistillConfig",
                           ["model=tiny-random", "teacher=tiny-random", "mode=logit"], FILES["sft"]()),
         check=lambda run: (run.tmp / "again" / "final").is_dir()),
    # ------------------------------------------------------------------ rs
    Case("rs-works", RS, WORKS, check=lambda run: run.json("out/summary.json")),
    Case("rs-no-sft", [*RS[:7], "sft=false"], WORKS, check=lambda run: (run.tmp / "out" / "round-1" / "kept.jsonl").is_file()),
    Case("rs-no-sft-train-key", [*RS[:7], "sft=false", "train.max_steps=3"], ERROR, mentions=("train.max_steps", "sft")),
    Case("rs-greedy-n2", [*RS, "temperature=0"], ERROR, mentions=("temperature",)),
    Case("rs-keep-above-no-threshold", [*RS, "keep=above"], ERROR, mentions=("threshold",)),
    Case("rs-unknown-reward", [*RS[:3], "reward=maths", *RS[4:]], ERROR, mentions=("maths",)),
    Case("rs-train-model-clash", [*RS, "train.model=smollm2-135m-instruct"], ERROR, mentions=("train.model",)),
    Case("rs-reward-args-bad-mode", [*RS, "reward_args={math: {mode: x}}"], ERROR, mentions=("reward_args", "mode")),
    Case("rs-own-config", ["rs", "--config", "{tmp}/run/config.yaml", "output_dir={tmp}/again"], WORKS,
         setup=_own_config("posttrain.recipes.rs:RSConfig", ["model=tiny-random", "n=2", "sft=false", "max_new_tokens=4"],
                           FILES["prompts"]()),
         check=lambda run: (run.tmp / "again" / "round-1" / "kept.jsonl").is_file()),
    # ------------------------------------------------------------------ plan, methods, models
    Case("plan-works", ["plan", "model=tiny-random", "method=grpo"], WORKS, check=_printed("grpo")),
    Case("plan-unknown-method", ["plan", "method=grpoo"], ERROR, mentions=("grpoo",)),
    Case("plan-bad-hardware", ["plan", "method=sft", "hardware=h1000"], ERROR, mentions=("h1000",)),
    Case("plan-batch-zero", ["plan", "method=sft", "batch=0"], ERROR, mentions=("batch",)),
    Case("methods-works", ["methods"], WORKS, check=_printed("grpo", "dpo")),
    Case("methods-one", ["methods", "grpo"], WORKS, check=_only_grpo),
    Case("methods-unknown", ["methods", "grpoo"], ERROR, mentions=("grpoo", "sft")),
    Case("models-works", ["models"], WORKS, check=_printed("tiny-random")),
    Case("models-fetch-unknown", ["models", "fetch", "nope-model"], ERROR, mentions=("nope-model",)),
    Case("models-unknown-subcommand", ["models", "remove"], ERROR, mentions=("models",)),
    # ------------------------------------------------------------------ rl options that do not apply, value_model
    Case("rl-kl-target-beta-0", [*RL, "beta=0", "kl_target=0.1"], ERROR, mentions=("kl_target", "beta")),
    Case("rl-pref-loss-with-grpo", [*RL, "pref_loss=ipo"], ERROR, mentions=("pref_loss", "online_dpo")),
    Case("rl-value-model-with-grpo", [*RL, "value_model={run:rm}/final"], ERROR, mentions=("value_model", "ppo")),
    Case("rl-advantage-with-online-dpo", [*RL, "algo=online_dpo", "advantage=rloo"], ERROR,
         mentions=("advantage", "online_dpo")),
    Case("rl-value-model-typo", [*RL, "algo=ppo", "value_model={tmp}/rm_typo"], ERROR, mentions=("value_model", "rm_typo")),
    Case("rl-value-model-is-policy", [*RL, "algo=ppo", "value_model={tmp}/policy"], ERROR, setup=_policy_folder,
         mentions=("value_model", "reward model")),
    Case("rl-loss-agg-unknown", [*RL, "loss_agg=foo"], ERROR, mentions=("loss_agg", "foo")),
    Case("rl-kv-cache-tiny", [*RL, "kv_cache_mb=0.001"], ERROR, mentions=("kv_cache_mb",)),
    Case("rl-reward-args-bad-mode", [*RL, "reward_args={math: {mode: x}}"], ERROR, mentions=("reward_args", "mode")),
    Case("rl-lr-inf", [*RL, "lr=.inf"], ERROR, mentions=("optim.lr", "finite")),
    # ------------------------------------------------------------------ models as inputs
    Case("dpo-model-is-adapter", [*DPO[:1], "model={tmp}/adapter", *DPO[2:]], WORKS, setup=_lora_adapter("tiny-random"),
         check=_final),
    Case("dpo-model-adapter-no-base", [*DPO[:1], "model={tmp}/adapter", *DPO[2:]], ERROR, setup=_lora_adapter(None),
         mentions=("adapter", "base_model_name_or_path")),
    Case("dpo-model-adapter-missing-base", [*DPO[:1], "model={tmp}/adapter", *DPO[2:]], ERROR,
         setup=_lora_adapter("{tmp}/gone"), mentions=("adapter", "gone")),
    Case("rm-model-typo-path", [*RM[:1], "model={tmp}/nope/model", *RM[2:]], ERROR, mentions=("nope/model",)),
    Case("rm-model-relative-typo", [*RM[:1], "model=./runs/nope", *RM[2:]], ERROR, mentions=("./runs/nope",)),
    # one slash reads as a Hub id (org/name), but runs/ is a folder here: refused at once, no Hub round trip
    Case("dpo-model-local-folder-typo", [*DPO[:1], "model=runs/nope", *DPO[2:]], ERROR,
         setup=lambda tmp: (tmp / "runs").mkdir(), mentions=("runs/nope", "runs/ is a local folder")),
]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_case(case, workspace, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths land in the case's folder
    classify(case, workspace, tmp_path)
