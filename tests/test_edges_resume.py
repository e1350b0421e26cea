"""Fuzz cases for the resume contract and output folders of every recipe (tests/edges.py): a resumed run
continues exactly the run it resumes or refuses, naming every changed key, before it touches anything;
output paths that cannot work are refused before any work; finished work is never changed.

Real finished runs (`{copy:sft}`, `{copy:rl}`) serve the cases that load a checkpoint; the refusals, which
happen before any model loads, also run against synthetic run folders (a config.yaml and a checkpoint's
state.json) so that every recipe is covered in milliseconds."""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from edges import ERROR, WORKS, Case, asserting, classify, ids
from posttrain.config import parse_args, save_yaml
from posttrain.outputs import to_json

pytestmark = pytest.mark.usefixtures("no_activation_probe")  # tests/conftest.py

WS: list = []  # the session's Workspace, for setups that build from its files and runs




def ws():
    return WS[0]


SFT = ["sft", "model=tiny-random", "data={sft}", "max_steps=2", "save_every=1"]  # tests/edges.py RUNS["sft"]
RL = ["rl", "model=tiny-random", "data={prompts}", "reward=math", "max_steps=2", "prompts_per_step=2", "group_size=2",
      "max_new_tokens=4", "save_every=1"]  # tests/edges.py RUNS["rl"]


def steps(run, folder: str) -> list[int]:
    return [json.loads(line)["step"] for line in (run.tmp / folder / "metrics.jsonl").read_text().splitlines() if line]


def own_copy(name: str, edit=None):
    """A setup: the finished run `name` copied to {tmp}/mine, then `edit(folder)`."""
    def setup(tmp: Path):
        dst = tmp / "mine"
        shutil.copytree(ws().run(name), dst)
        if edit is not None:
            edit(dst)
    return setup


def recorded(change: dict):
    """An edit: the run's record (config.yaml and every checkpoint's state.json) as if made with `change`."""
    def edit(folder: Path):
        config = yaml.safe_load((folder / "config.yaml").read_text())
        config.update(change)
        (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        for state_file in folder.glob("checkpoints/step-*/state.json"):
            state = json.loads(state_file.read_text())
            state["run"]["config"].update(change)
            state_file.write_text(json.dumps(state))
    return edit


def data_moved(rows: int, file: str = "sft"):
    """An edit: the run as if trained on {tmp}/mine/data.jsonl (a copy of `file`), which then shrinks to `rows`."""
    def edit(folder: Path):
        src = ws().file(file)
        data = folder / "data.jsonl"
        shutil.copy(src, data)
        recorded({"data": str(data)})(folder)
        data.write_text("".join(src.read_text().splitlines(keepends=True)[:rows]))
    return edit


def fake_run(recipe: str, argv: list[str], change: dict, step: int = 1, rounds: bool = False):
    """A setup: {tmp}/run as a `recipe` run made with `argv` + `change` (config.yaml, a checkpoint's state.json;
    rs: a finished round). No weights: what the resume check reads before any model loads."""
    def setup(tmp: Path):
        from posttrain.recipes.distill.config import DistillConfig
        from posttrain.recipes.dpo import DPOConfig
        from posttrain.recipes.rm import RMConfig
        from posttrain.recipes.rs import RSConfig
        from posttrain.recipes.sft import SFTConfig

        cls = {"sft": SFTConfig, "dpo": DPOConfig, "rm": RMConfig, "rs": RSConfig, "distill": DistillConfig}[recipe]
        out = tmp / "run"
        filled = [a.replace("{tmp}", str(tmp)) for a in argv]
        filled = [a if "{" not in a else a.split("=")[0] + "=" + str(ws().file(a.split("{")[1].rstrip("}")))
                  for a in filled]
        cfg = parse_args(cls, [*filled, *(f"{k}={v}" for k, v in change.items()), f"output_dir={out}"])
        out.mkdir(parents=True)
        save_yaml(cfg, out / "config.yaml")
        if rounds:
            (out / "round-1").mkdir()
            (out / "round-1" / "round.json").write_text('{"row": {}, "model": "tiny-random"}')
        else:
            (out / "checkpoints" / f"step-{step}").mkdir(parents=True)
            state = {"step": step, "run": {"config": cfg.model_dump(mode="json"), "data_sha256": None}}
            (out / "checkpoints" / f"step-{step}" / "state.json").write_text(json.dumps(state))
    return setup


def a_file(name: str = "f"):
    def setup(tmp: Path):
        (tmp / name).write_text("not a folder")
    return setup


def a_folder(tmp: Path):
    (tmp / "dir").mkdir()
    (tmp / "dir" / "old.jsonl").write_text('{"kept": true}\n')


DPO = ["dpo", "model=tiny-random", "data={pref}", "max_steps=2"]
RM = ["rm", "model=tiny-random", "data={pref}", "max_steps=2"]
RS = ["rs", "model=tiny-random", "data={prompts}", "reward=math", "n=2", "rounds=2"]
LOGIT = ["distill", "mode=logit", "model=tiny-random", "teacher=tiny-random", "data={sft}", "max_steps=2"]
SEQUENCE = ["distill", "mode=sequence", "model=tiny-random", "teacher=tiny-random", "data={prompts}", "max_steps=2"]
ON_POLICY = ["distill", "mode=on_policy", "model=tiny-random", "teacher=tiny-random", "data={prompts}", "max_steps=2"]


def config_lr(run, lr: float) -> bool:
    return yaml.safe_load((run.tmp / "mine" / "config.yaml").read_text())["optim"]["lr"] == lr


CASES = [
    # ---- sft on its finished run: every changed trajectory key is refused, config.yaml untouched
    Case("sft-resume-changed-lr", [*SFT, "optim.lr=1e-3", "output_dir={copy:sft}", "resume=true"], ERROR,
         mentions=("optim.lr", "resume=force"), keep=("{copy:sft}",)),  # was: accepted, config.yaml overwritten
    Case("sft-resume-changed-seed", [*SFT, "seed=7", "output_dir={copy:sft}", "resume=true"], ERROR,
         mentions=("seed: 0 -> 7",), keep=("{copy:sft}",)),
    Case("sft-resume-changed-max-length", [*SFT, "max_length=64", "output_dir={copy:sft}", "resume=true"], ERROR,
         mentions=("max_length",), keep=("{copy:sft}",)),
    Case("sft-resume-lora-on", [*SFT, "lora.enabled=true", "output_dir={copy:sft}", "resume=true"], ERROR,
         mentions=("lora.enabled",), keep=("{copy:sft}",)),
    Case("sft-resume-max-steps-below", [*SFT[:3], "max_steps=1", "output_dir={copy:sft}", "resume=true"], ERROR,
         mentions=("max_steps=1", "step 2"), keep=("{copy:sft}",)),
    Case("sft-resume-force-lr", [*SFT[:3], "max_steps=3", "optim.lr=1e-3", "output_dir={tmp}/mine", "resume=force"],
         WORKS, setup=own_copy("sft"),
         check=lambda run: config_lr(run, 1e-3) and steps(run, "mine") == [1, 2, 3] and "resume=force" in run.out),
    Case("sft-resume-free-keys", [*SFT[:3], "max_steps=3", "save_every=3", "keep_checkpoints=3", "output_dir={tmp}/mine",
                                  "resume=true"], WORKS, setup=own_copy("sft"),
         check=lambda run: steps(run, "mine") == [1, 2, 3] and "resume=force" not in run.out),
    Case("sft-resume-data-changed", [*SFT[:2], "data={tmp}/mine/data.jsonl", *SFT[3:], "output_dir={tmp}/mine",
                                     "resume=true"], ERROR, setup=own_copy("sft", data_moved(4)),
         mentions=("data", "data.jsonl")),  # was: IndexError
    Case("rl-resume-data-shrank-force", [*RL[:2], "data={tmp}/mine/data.jsonl", *RL[3:], "output_dir={tmp}/mine",
                                         "resume=force"], ERROR, setup=own_copy("rl", data_moved(3, "prompts")),
         mentions=("3 training items", "had 8")),  # was: IndexError
    Case("rl-resume-data-by-another-path", [*RL[:2], "data={tmp}/mine/same.jsonl", *RL[3:], "output_dir={tmp}/mine",
                                            "resume=true"], WORKS,  # the same bytes under another name: the same data
         setup=own_copy("rl", lambda folder: shutil.copy(ws().file("prompts"), folder / "same.jsonl")),
         check=lambda run: steps(run, "mine") == [1, 2] and "resume=force" not in run.out),
    Case("sft-resume-lora-on-force", [*SFT, "lora.enabled=true", "output_dir={tmp}/mine", "resume=force"], ERROR,
         setup=own_copy("sft"), mentions=("checkpoint",)),  # was: a raw traceback
    Case("sft-resume-other-model-force", [*SFT, "model=tiny-random-qwen2", "output_dir={tmp}/mine", "resume=force"],
         ERROR, setup=own_copy("sft"), mentions=("checkpoint",)),
    Case("sft-resume-without-checkpoint-in-existing-folder", [*SFT[:3], "max_steps=1", "output_dir={tmp}/dir",
                                                              "resume=true"], WORKS, setup=a_folder,
         keep=("{tmp}/dir/old.jsonl",), check=lambda run: "no checkpoint" in run.out and (run.tmp / "dir" / "final").is_dir()),
    Case("sft-fresh-over-finished-run", [*SFT, "output_dir={copy:sft}"], ERROR, mentions=("resume=true",),
         keep=("{copy:sft}",)),
    # ---- rl on its finished run
    Case("rl-resume-changed-group-size", [*RL, "group_size=4", "output_dir={copy:rl}", "resume=true"], ERROR,
         mentions=("group_size: 2 -> 4",), keep=("{copy:rl}",)),
    Case("rl-resume-changed-lr-and-seed", [*RL, "optim.lr=1e-3", "seed=3", "output_dir={copy:rl}", "resume=true"],
         ERROR, mentions=("optim.lr", "seed"), keep=("{copy:rl}",)),
    Case("rl-resume-changed-max-new-tokens", [*RL, "max_new_tokens=8", "output_dir={copy:rl}", "resume=true"], ERROR,
         mentions=("sampling.max_new_tokens",), keep=("{copy:rl}",)),
    Case("rl-resume-grpo-to-ppo", [*RL, "algo=ppo", "output_dir={copy:rl}", "resume=true"], ERROR,
         mentions=("algo: 'grpo' -> 'ppo'",), keep=("{copy:rl}",)),
    Case("rl-resume-grpo-to-ppo-force", [*RL, "algo=ppo", "output_dir={tmp}/mine", "resume=force"], ERROR,
         setup=own_copy("rl"), mentions=("no value model",)),  # was: a raw traceback
    Case("rl-resume-ppo-to-grpo", [*RL, "output_dir={tmp}/mine", "resume=true"], ERROR,
         setup=own_copy("rl", recorded({"algo": "ppo"})), mentions=("algo: 'ppo' -> 'grpo'",)),  # was: value model dropped
    Case("rl-resume-lora-on", [*RL, "lora.enabled=true", "output_dir={copy:rl}", "resume=true"], ERROR,
         mentions=("lora.enabled",), keep=("{copy:rl}",)),
    Case("rl-resume-other-model", [*RL, "model=tiny-random-qwen2", "output_dir={copy:rl}", "resume=true"], ERROR,
         mentions=("model",), keep=("{copy:rl}",)),
    Case("rl-resume-max-steps-below", [*RL[:4], "max_steps=1", *RL[5:], "output_dir={copy:rl}", "resume=true"], ERROR,
         mentions=("max_steps=1", "step 2"), keep=("{copy:rl}",)),  # was: steps=1, negative predicted tokens
    Case("rl-resume-extend", [*RL[:4], "max_steps=3", *RL[5:], "output_dir={tmp}/mine", "resume=true"], WORKS,
         setup=own_copy("rl"),
         check=lambda run: steps(run, "mine") == [1, 2, 3] and json.loads((run.tmp / "mine" / "summary.json").read_text())[
             "tokens predicted (plan)"] > 0),
    # ---- the other recipes: refusals before any model loads (synthetic run folders)
    Case("dpo-resume-changed-beta", [*DPO, "beta=0.5", "output_dir={tmp}/run", "resume=true"], ERROR,
         setup=fake_run("dpo", DPO[1:], {"beta": 0.1}), mentions=("beta",), keep=("{tmp}/run",)),
    Case("dpo-resume-changed-loss", [*DPO, "loss=ipo", "output_dir={tmp}/run", "resume=true"], ERROR,
         setup=fake_run("dpo", DPO[1:], {}), mentions=("loss: 'dpo' -> 'ipo'",), keep=("{tmp}/run",)),
    Case("dpo-resume-max-steps-below", [*DPO, "output_dir={tmp}/run", "resume=true"], ERROR,
         setup=fake_run("dpo", DPO[1:], {}, step=5), mentions=("max_steps=2", "step 5")),
    Case("rm-resume-changed-lr", [*RM, "optim.lr=0.1", "output_dir={tmp}/run", "resume=true"], ERROR,
         setup=fake_run("rm", RM[1:], {}), mentions=("optim.lr",), keep=("{tmp}/run",)),
    Case("rs-resume-changed-n", [*RS, "n=4", "output_dir={tmp}/run", "resume=true"], ERROR,
         setup=fake_run("rs", RS[1:], {}, rounds=True), mentions=("n: 2 -> 4",), keep=("{tmp}/run",)),  # was: accepted
    Case("rs-resume-changed-threshold", [*RS, "threshold=0.9", "output_dir={tmp}/run", "resume=true"], ERROR,
         setup=fake_run("rs", RS[1:], {}, rounds=True), mentions=("threshold",), keep=("{tmp}/run",)),
    Case("distill-logit-resume-changed-top-k", [*LOGIT, "top_k=8", "output_dir={tmp}/run", "resume=true"], ERROR,
         setup=fake_run("distill", LOGIT[1:], {}), mentions=("top_k",), keep=("{tmp}/run",)),
    Case("distill-sequence-resume-changed-teacher", [*SEQUENCE, "teacher=tiny-random-qwen2", "output_dir={tmp}/run",
                                                     "resume=true"], ERROR,
         setup=fake_run("distill", SEQUENCE[1:], {}), mentions=("teacher",), keep=("{tmp}/run",)),
    Case("distill-on-policy-resume-changed-divergence", [*ON_POLICY, "divergence=forward_kl", "output_dir={tmp}/run",
                                                         "resume=true"], ERROR,
         setup=fake_run("distill", ON_POLICY[1:], {}), mentions=("divergence",), keep=("{tmp}/run",)),
    # ---- output paths: refused before any work, whatever the command
    Case("sft-output-dir-is-file", [*SFT[:3], "output_dir={tmp}/f"], ERROR, setup=a_file(),
         mentions=("output_dir", "is a file"), keep=("{tmp}/f",)),
    Case("rl-output-dir-under-file", [*RL, "output_dir={tmp}/f/run"], ERROR, setup=a_file(),
         mentions=("output_dir", "is a file")),
    Case("dpo-output-dir-is-file", [*DPO, "output_dir={tmp}/f"], ERROR, setup=a_file(), mentions=("output_dir",)),
    Case("rm-output-dir-is-file", [*RM, "output_dir={tmp}/f"], ERROR, setup=a_file(), mentions=("output_dir",)),
    Case("rs-output-dir-is-file", [*RS, "output_dir={tmp}/f"], ERROR, setup=a_file(), mentions=("output_dir",)),
    Case("distill-output-dir-under-file", [*SEQUENCE, "output_dir={tmp}/f/x"], ERROR, setup=a_file(),
         mentions=("output_dir",)),
    Case("eval-output-dir-is-file", ["eval", "model=tiny-random", "data={prompts}", "reward=math", "n=1",
                                     "output_dir={tmp}/f"], ERROR, setup=a_file(), mentions=("output_dir", "is a file")),
    Case("rm-probe-output-dir-is-file", ["rm", "probe", "rm={tmp}/nope", "data={pref}", "output_dir={tmp}/f"], ERROR,
         setup=a_file(), mentions=("output_dir",)),
    Case("generate-output-is-folder", ["generate", "model=tiny-random", "data={prompts}", "output={tmp}/dir"], ERROR,
         setup=a_folder, mentions=("output", "is a folder"), keep=("{tmp}/dir",)),  # was: samples made, then lost
    Case("label-output-is-folder", ["label", "data={prompts}", "samples_a={tmp}/dir/old.jsonl",
                                    "judge.base_url=http://127.0.0.1:9/v1", "output={tmp}/dir"], ERROR,
         setup=a_folder, mentions=("output", "is a folder"), keep=("{tmp}/dir",)),  # was: verdicts made, then lost
    Case("score-output-is-folder", ["score", "data={completions}", "reward=math", "output={tmp}/dir"], ERROR,
         setup=a_folder, mentions=("output", "is a folder"), keep=("{tmp}/dir",)),
    Case("score-output-under-file", ["score", "data={completions}", "reward=math", "output={tmp}/f/o.jsonl"], ERROR,
         setup=a_file(), mentions=("output", "is a file")),
    Case("data-export-output-is-folder", ["data", "export", "data={prompts}", "output={tmp}/dir"], ERROR, setup=a_folder,
         mentions=("output", "is a folder"), keep=("{tmp}/dir",)),
]

for _case in CASES:  # a check written as an expression (a lambda) fails when it is False
    _case.check = asserting(_case.check)


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_case(case, workspace, tmp_path, monkeypatch):
    WS[:] = [workspace]
    monkeypatch.chdir(tmp_path)
    classify(case, workspace, tmp_path)


def test_json_writer_writes_null_for_non_finite_values():
    """summary.json, round.json, probe.json ... go through posttrain.outputs.to_json: strict parsers read them."""
    import numpy as np

    text = to_json({"a": float("nan"), "b": [1.5, float("inf"), -float("inf")], "c": np.float32(2.5), "d": (np.nan,)})
    assert json.loads(text, parse_constant=lambda name: pytest.fail(f"bare {name}")) == {
        "a": None, "b": [1.5, None, None], "c": 2.5, "d": [None]}
