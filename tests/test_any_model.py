"""Every recipe on the tiny random model of every architecture family (posttrain.models.builtin.TINY_CONFIGS),
through the CLI as a user runs it, with the default `backend=auto`; and what a user bringing a base model
(no chat template) or LoRA gets.

Each run is one or two steps on a handful of rows: these tests prove the paths run end to end on each
family (shapes, attention variants, soft-capping, fused projections, tied or untied heads, the backend
`auto` picks); the math of each family is checked against transformers in test_engine_arch.py and
test_forward_arch.py.
"""

import json

import pytest

from conftest import COUNT_PROMPTS, write_jsonl
from posttrain import cli
from posttrain.models.builtin import TINY_CONFIGS
from posttrain.rewards.base import register
from preference_synthetic import rule_pairs

ARCHS = [n for n in TINY_CONFIGS if n != "tiny-random"]  # tiny-random (llama) runs through every other test


@register("space_count", description="test reward: spaces in the completion")
def space_count(prompts, completions, **kw):
    return [float(c.count(" ")) for c in completions]


def posttrain(*argv) -> None:
    assert cli.main([str(a) for a in argv]) == 0, argv


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    return {"prompts": write_jsonl(d / "prompts.jsonl", COUNT_PROMPTS[:4]),
            "pairs": write_jsonl(d / "pairs.jsonl", rule_pairs(12))}


RL = ("data={prompts}", "reward=space_count", "prompts_per_step=2", "group_size=2", "sampling.max_new_tokens=6",
      "max_steps=2", "progress=false")
RECIPES = {
    "sft": ("sft", "data=arithmetic:12", "max_steps=2", "batch_size=4", "eval_fraction=0.25", "sample_every=0",
            "forgetting_probe=false", "progress=false"),
    "rm": ("rm", "data={pairs}", "max_steps=2", "batch_size=4", "eval_fraction=0.25", "progress=false"),
    "dpo": ("dpo", "data={pairs}", "max_steps=2", "batch_size=4", "eval_fraction=0.25", "length_probe.prompts=2",
            "length_probe.max_new_tokens=4", "progress=false"),
    "grpo": ("rl", *RL),
    "ppo": ("rl", "algo=ppo", *RL),
    "rs": ("rs", "data={prompts}", "reward=space_count", "n=2", "sampling.max_new_tokens=6", "keep_truncated=true", "train.max_steps=1",
           "train.batch_size=2", "progress=false"),
    "distill_on_policy": ("distill", "mode=on_policy", "teacher={model}", *RL),
    "distill_logit": ("distill", "mode=logit", "teacher={model}", "data=arithmetic:8", "max_steps=1", "batch_size=4",
                      "progress=false"),
    "distill_sequence": ("distill", "mode=sequence", "teacher={model}", "data={prompts}", "n=2", "max_steps=1", "keep_truncated=true",
                         "sampling.max_new_tokens=6", "batch_size=2", "progress=false"),
    "eval": ("eval", "data=single_digit_add:all", "max_items=3", "n=2", "sampling.max_new_tokens=4", "workers=1"),
}


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("arch", ARCHS)
def test_every_recipe_runs_on_every_family(tmp_path, files, arch, recipe):
    name, *args = RECIPES[recipe]
    args = [a.format(model=arch, **files) for a in args]
    out = tmp_path / recipe
    posttrain(name, f"model={arch}", *args, f"output_dir={out}")
    if name == "eval":
        assert json.loads((out / "results.json").read_text())["protocol"]["backend"] in ("builtin", "hf")
    elif name == "rs":
        assert (out / "round-1" / "kept.jsonl").exists()
    elif recipe == "distill_sequence":
        assert (out / "sft" / "final" / "config.json").exists()
    else:
        assert (out / "final" / "config.json").exists()
        plan = json.loads((out / "plan.json").read_text())  # the planner knows every family (never blocks)
        assert plan


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_and_serve_on_every_family(tmp_path, files, arch):
    import httpx

    from posttrain.rollout.serve import ServeConfig, ServerThread, build_worker, make_app

    out = tmp_path / "samples.jsonl"
    posttrain("generate", f"model={arch}", f"data={files['prompts']}", "n=2", "max_new_tokens=5", f"output={out}")
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 8 and all(len(x["token_ids"]) == len(x["logprobs"]) >= 1 for x in lines)
    worker, tok = build_worker(ServeConfig(model=arch, max_num_seqs=4, kv_cache_mb=16, max_model_len=256))
    try:
        with ServerThread(make_app(worker, tok, arch, 5)) as srv:
            r = httpx.post(srv.base_url + "/chat/completions", timeout=60,
                           json={"messages": [{"role": "user", "content": "hi"}], "n": 2})
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"]) == 2
    finally:
        worker.close()


# ---------------------------------------------------------------- base models (no chat template)


@pytest.fixture
def base_model(tmp_path):
    """A saved tiny model whose tokenizer has no chat template (what a base model ships)."""
    from posttrain.models.builtin import build_tiny
    from posttrain.models.loading import load_tokenizer

    path = tmp_path / "base"
    tok = load_tokenizer("tiny-random-qwen3")
    tok.chat_template = None
    build_tiny("tiny-random-qwen3").save_pretrained(path)
    tok.save_pretrained(path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    return str(path)


@pytest.mark.parametrize("command", ["sft", "rl", "dpo", "eval", "generate"])
def test_conversations_on_a_base_model_are_refused_before_weights_load(tmp_path, files, base_model, command, monkeypatch,
                                                                      capsys):
    import importlib

    def no_weights(*a, **k):
        raise AssertionError("model weights loaded before the data was refused")

    names = ("posttrain.recipes.sft", "posttrain.recipes.rl.build", "posttrain.recipes.dpo", "posttrain.eval.cli",
             "posttrain.rollout.cli", "posttrain.models.loading")
    modules = [importlib.import_module(n) for n in names]  # imported first: every `from ... import load_model` is bound
    for module in modules:  # the loader and every module that bound it by name
        if hasattr(module, "load_model"):
            monkeypatch.setattr(module, "load_model", no_weights)
    data = {"sft": "arithmetic:8", "rl": files["prompts"], "dpo": files["pairs"], "eval": files["prompts"],
            "generate": files["prompts"]}[command]
    where = f"output={tmp_path / 'o.jsonl'}" if command == "generate" else f"output_dir={tmp_path / 'run'}"
    extra = ["reward=space_count"] if command == "eval" else []
    code = cli.main([command, f"model={base_model}", f"data={data}", where, *extra])
    err = capsys.readouterr().err
    assert code == 2 and "chat_template=" in err and "no chat template" in err, err


def test_a_base_model_trains_with_a_builtin_template_and_plain_prompts(tmp_path, files, base_model):
    """chat_template=plain renders the conversations; string prompts need no template at all."""
    posttrain("sft", f"model={base_model}", "data=arithmetic:8", "chat_template=plain", "max_steps=1", "batch_size=4",
              "eval_fraction=0", "sample_every=0", "forgetting_probe=false", f"output_dir={tmp_path / 'sft'}", "progress=false")
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": f"Count to {d}:"} for d in range(1, 5)])
    posttrain("rl", f"model={base_model}", f"data={plain}", *RL[1:], f"output_dir={tmp_path / 'rl'}")
    out = tmp_path / "s.jsonl"
    posttrain("generate", f"model={base_model}", f"data={plain}", "max_new_tokens=3", f"output={out}")
    first = json.loads(out.read_text().splitlines()[0])
    assert first["token_ids"]


def test_chat_template_option_names_an_unknown_template(tmp_path, capsys):
    code = cli.main(["sft", "model=tiny-random", "data=arithmetic:4", "chat_template=no_such_template",
                     f"output_dir={tmp_path}"])
    assert code == 2 and "chat_template='no_such_template'" in capsys.readouterr().err


# ---------------------------------------------------------------- backends and LoRA


def test_builtin_backend_on_an_unsupported_architecture_names_the_ones_that_work():
    from posttrain.errors import UserError
    from posttrain.rollout.backends import choose

    class Unknown:
        class config:
            model_type = "some_new_arch"

    with pytest.raises(UserError, match="backend=hf"):
        choose("builtin", Unknown())
    assert choose("auto", Unknown())[0] == "hf"


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_lora_rl_trains_the_adapter_against_the_base(tmp_path, files, algo):
    """LoRA RL: only adapter weights change, π_ref is the base (the KL is measured against it), final/adapter/."""
    out = tmp_path / "run"
    posttrain("rl", "model=tiny-random-qwen2", f"algo={algo}", *(a.format(**files) for a in RL), "beta=0.05", "lora.enabled=true", "lora.r=4",
              "optim.lr=5e-2", f"output_dir={out}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["kl"] > 0  # the adapter moved the policy away from the base
    assert (out / "final" / "adapter" / "adapter_config.json").exists()
    assert all(r["consistency/dlogp_max"] < 1e-3 for r in rows)  # the sampler samples the adapted weights


def test_gradient_checkpointing_gives_the_same_update(tmp_path):
    """Checkpointing recomputes activations; the loss and the weights after a step are those without it (fp32)."""
    import torch
    from safetensors.torch import load_file

    runs = {}
    for gc in (False, True):
        out = tmp_path / f"gc{gc}"
        posttrain("sft", "model=tiny-random-gemma3", "data=arithmetic:8", "max_steps=1", "batch_size=4",
                  "eval_fraction=0", "sample_every=0", "forgetting_probe=false", f"gradient_checkpointing={str(gc).lower()}",
                  f"output_dir={out}", "progress=false")
        runs[gc] = load_file(out / "final" / "model.safetensors")
    for k, v in runs[False].items():
        torch.testing.assert_close(runs[True][k], v, rtol=1e-5, atol=1e-6)


def test_chat_template_args_reach_every_render(tmp_path):
    """chat_template_args={enable_thinking: false} is fixed in the template, as Qwen3 users switch thinking off."""
    from posttrain.data.templates import render_prompt
    from posttrain.errors import UserError
    from posttrain.models.loading import load_tokenizer

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                        "{% if add_generation_prompt %}{% if enable_thinking is defined and not enable_thinking %}"
                        " [no-think]{% else %} [think]{% endif %}{% endif %}")
    prompt = [{"role": "user", "content": "hi"}]
    plain = load_tokenizer("tiny-random", str(template))
    off = load_tokenizer("tiny-random", str(template), {"enable_thinking": False})
    assert plain.decode(render_prompt(plain, prompt)).endswith("[think]")
    assert off.decode(render_prompt(off, prompt)).endswith("[no-think]")
    with pytest.raises(UserError, match="not template variable names"):
        load_tokenizer("tiny-random", "", {"bad name": 1})
