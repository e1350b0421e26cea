"""Fuzz cases for `posttrain rl` (every algo family, sizes at the edges, file rewards, agentic user envs),
`posttrain score` with file rewards and `posttrain quickstart`'s checks (tests/edges.py: each case works or
stops with one clear line; finished work is never touched)."""

import json
import math
from pathlib import Path

import pytest

from edges import ERROR, WORKS, Case, asserting, classify, ids

pytestmark = pytest.mark.usefixtures("no_activation_probe")  # tests/conftest.py

BASE = ["rl", "model=tiny-random", "data={prompts}", "reward=math", "output_dir={tmp}/out", "max_steps=1",
        "prompts_per_step=2", "group_size=2", "max_new_tokens=4"]


def strict_json(path: Path):
    """json.loads that refuses NaN / Infinity, as strict parsers (jq, JSON.parse) do."""
    def refuse(name):
        raise AssertionError(f"{path}: bare {name} is not JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


def summary_of(run) -> dict:
    return strict_json(run.tmp / "out" / "summary.json")


def steps_logged(run) -> list[int]:
    return [json.loads(line)["step"] for line in (run.tmp / "out" / "metrics.jsonl").read_text().splitlines() if line]


def ran(algo: str, value_model: bool = False):
    def check(run):
        s = summary_of(run)
        assert s["algo"] == algo and s["steps"] == 1 and steps_logged(run) == [1]
        assert s["skipped_steps"] == 0, "the step was skipped: nothing was trained"
        assert (run.tmp / "out" / "final" / "config.json").is_file()
        assert (run.tmp / "out" / "final" / "value").is_dir() == value_model
        row = json.loads((run.tmp / "out" / "metrics.jsonl").read_text().splitlines()[0])
        assert row["reward/mean"] is None or math.isfinite(row["reward/mean"])
    return check




def write(name: str, text: str):
    def setup(tmp: Path):
        (tmp / name).write_text(text)
    return setup


def rows_file(name: str, rows: list):
    return write(name, "".join(json.dumps(r) + "\n" for r in rows))


REWARDS = '''
import sys, time

def ok(completions, **kw):
    return [0.5 for _ in completions]

def short(completions, **kw):
    return [1.0] * (len(completions) - 1)

def words(completions, **kw):
    return ["good" for _ in completions]

def as_dict(completions, **kw):
    return {"reward": 1.0}

def exits(completions, **kw):
    sys.exit(3)

def hangs(completions, **kw):
    time.sleep(30)
hangs.timeout = 0.3

def raises(completions, **kw):
    raise ValueError("my reward broke")

def no_completions(x):
    return [1.0]

def lengthy(completions, **kw):
    return [float(len(c)) for c in completions]

def bad_timeout(completions, **kw):
    return [1.0] * len(completions)
bad_timeout.timeout = "soon"
'''
with_rewards = write("r.py", REWARDS)


ENVS = '''
from posttrain.agentic.env import Environment

class Echo:
    """The documented protocol (reset/step/reward) and nothing else: no `tools`, no base class."""
    def reset(self, row, seed):
        return [{"role": "user", "content": row["prompt"]}]
    def step(self, action):
        return None, True, {}
    def reward(self, episode):
        return float(len(episode.final_text) > 0)

class Stringy(Echo):
    def reset(self, row, seed):
        return row["prompt"]  # a string: the first user message

class Number(Echo):
    def reset(self, row, seed):
        return 42
'''
with_envs = write("envs.py", ENVS)

QUICKSTART = ["quickstart", "model=tiny-random", "eval.data={heldout}", "eval.n=1", "eval.k=[1]", "rl.data={prompts}",
              "rl.max_steps=1", "rl.prompts_per_step=2", "rl.group_size=2", "rl.sampling.max_new_tokens=4"]


def precious_folder(tmp: Path):
    (tmp / "mine").mkdir()
    (tmp / "mine" / "thesis.txt").write_text("four years of work")


def finished_quickstart_rl(tmp: Path):
    """A quickstart folder whose RL stage finished with lr 1e-6 (config.yaml, a checkpoint, summary, final/)."""
    from posttrain.config import parse_args, save_yaml
    from posttrain.recipes.rl import RLConfig

    rl = tmp / "qs" / "rl"
    (rl / "checkpoints" / "step-1").mkdir(parents=True)
    (rl / "final").mkdir()
    cfg = parse_args(RLConfig, ["model=tiny-random", f"data={tmp}/unused.jsonl", "optim.lr=1e-6", f"output_dir={rl}"])
    save_yaml(cfg, rl / "config.yaml")
    (rl / "checkpoints" / "step-1" / "state.json").write_text('{"step": 1}')
    (rl / "summary.json").write_text("{}")
    (rl / "final" / "config.json").write_text("{}")


CASES = [
    # ---- every algo family, one tiny step each (works: trained, logged, final/ written), each with one edge more
    Case("rl-grpo-eval-every-above-max-steps", [*BASE, "eval.data={heldout}", "eval.every=50", "eval.n=1", "eval.k=[1]"],
         WORKS, check=lambda run: ran("grpo")(run) is None and "eval/pass@1" in json.loads(
             (run.tmp / "out" / "metrics.jsonl").read_text().splitlines()[-1])),  # the last step is evaluated
    Case("rl-dr_grpo-max-new-tokens-1", [*BASE, "algo=dr_grpo", "max_new_tokens=1"], WORKS, check=ran("dr_grpo")),
    Case("rl-dapo-prompts-per-step-above-data", [*BASE, "algo=dapo", "dynamic_sampling=false", "data={one_prompt}",
                                                 "prompts_per_step=3"], WORKS, check=ran("dapo")),
    Case("rl-gspo-save-every-above-max-steps", [*BASE, "algo=gspo", "save_every=50"], WORKS,
         check=lambda run: ran("gspo")(run) is None and [p.name for p in (run.tmp / "out" / "checkpoints").iterdir()] == ["step-1"]),
    Case("rl-cispo-micro-batch-below-a-sample", [*BASE, "algo=cispo", "micro_batch_tokens=64", "data={tmp}/long.jsonl"],
         WORKS, setup=rows_file("long.jsonl", [{"prompt": "Add these numbers carefully: " + " + ".join(["12"] * 40) + ".",
                                                "answer": "480"}] * 2), check=ran("cispo")),
    Case("rl-rloo-file-reward", [*BASE, "algo=rloo", "reward=math:1.0,{tmp}/r.py:ok:0.5"], WORKS, setup=with_rewards,
         check=lambda run: ran("rloo")(run) is None and json.loads((run.tmp / "out" / "metrics.jsonl").read_text()
                                                                   .splitlines()[0])["rewards/r.py:ok/mean"] == 0.5),
    Case("rl-reinforce_pp-group-size-1", [*BASE, "group_size=1", "algo=reinforce_pp"], WORKS,  # was: refused
         check=ran("reinforce_pp")),
    Case("rl-ppo-group-size-1", [*BASE, "group_size=1", "algo=ppo", "ppo_epochs=1", "ppo_minibatches=1"], WORKS,
         check=ran("ppo", value_model=True)),
    Case("rl-online_dpo", [*BASE, "algo=online_dpo", "reward={tmp}/r.py:lengthy"], WORKS, setup=with_rewards,
         check=ran("online_dpo")),
    Case("rl-unknown-algo", [*BASE, "algo=grpo2"], ERROR, mentions=("algo",)),
    # ---- sizes at the edges
    Case("rl-group-size-1-grpo", [*BASE, "group_size=1"], ERROR, mentions=("group_size=1", "algo=ppo")),
    Case("rl-group-size-1-online-dpo", [*BASE, "group_size=1", "algo=online_dpo"], ERROR, mentions=("group_size=1",)),
    Case("rl-group-size-0", [*BASE, "group_size=0"], ERROR, mentions=("group_size",)),
    Case("rl-prompts-per-step-0", [*BASE, "prompts_per_step=0"], ERROR, mentions=("prompts_per_step",)),
    Case("rl-max-steps-0", [*BASE, "max_steps=0"], WORKS,  # summary.json had bare NaN (no reward logged)
         check=lambda run: (summary_of(run)["first_reward"] is None and summary_of(run)["steps"] == 0
                            and (run.tmp / "out" / "final" / "config.json").is_file())),
    Case("rl-temperature-0", [*BASE, "sampling.temperature=0"], ERROR, mentions=("temperature",)),
    Case("rl-top-p-0", [*BASE, "sampling.top_p=0"], ERROR, mentions=("top_p",)),
    Case("rl-prompt-longer-than-context", [*BASE, "engine.max_model_len=16", "data={tmp}/long.jsonl"], ERROR,
         setup=rows_file("long.jsonl", [{"prompt": "Add: " + " + ".join(["12"] * 40), "answer": "480"}] * 2),
         mentions=("long.jsonl:1", "prompt", "max_model_len")),
    # ---- data the reward cannot score
    Case("rl-null-answer", [*BASE, "data={tmp}/d.jsonl"], ERROR,  # was: every step skipped, exit 0
         setup=rows_file("d.jsonl", [{"prompt": "1+1?", "answer": "2"}, {"prompt": "2+2?", "answer": None}]),
         mentions=("d.jsonl:2", "answer")),
    Case("rl-missing-answer", [*BASE, "data={tmp}/d.jsonl"], ERROR,
         setup=rows_file("d.jsonl", [{"prompt": "1+1?"}, {"prompt": "2+2?"}]), mentions=("d.jsonl:1", "answer")),
    # ---- rewards in the user's files
    Case("rl-file-reward-missing-file", [*BASE, "reward={tmp}/nope.py:ok"], ERROR, mentions=("nope.py",)),
    Case("rl-file-reward-missing-function", [*BASE, "reward={tmp}/r.py:okk"], ERROR, setup=with_rewards,
         mentions=("okk", "did you mean 'ok'")),
    Case("rl-file-reward-wrong-signature", [*BASE, "reward={tmp}/r.py:no_completions"], ERROR, setup=with_rewards,
         mentions=("r.py:no_completions", "completions")),
    Case("rl-file-reward-wrong-length", [*BASE, "reward={tmp}/r.py:short"], ERROR, setup=with_rewards,
         mentions=("r.py:short", "list of 4 values, got 3")),
    Case("rl-file-reward-wrong-type", [*BASE, "reward={tmp}/r.py:words"], ERROR, setup=with_rewards,
         mentions=("r.py:words", "non-number")),
    Case("rl-file-reward-returns-dict", [*BASE, "reward={tmp}/r.py:as_dict"], ERROR, setup=with_rewards,
         mentions=("r.py:as_dict", "list of 4 values")),
    Case("rl-file-reward-raises", [*BASE, "reward={tmp}/r.py:raises"], ERROR, setup=with_rewards,
         mentions=("r.py:raises", "my reward broke")),
    Case("rl-file-reward-sys-exit", [*BASE, "reward={tmp}/r.py:exits"], ERROR, setup=with_rewards,  # was: silent exit 3
         mentions=("r.py:exits", "sys.exit(3)")),
    Case("rl-file-reward-hangs", [*BASE, "reward={tmp}/r.py:hangs"], ERROR, setup=with_rewards,  # was: hung forever
         mentions=("r.py:hangs", "did not return within 0.3 s")),
    Case("rl-file-reward-bad-timeout", [*BASE, "reward={tmp}/r.py:bad_timeout"], ERROR, setup=with_rewards,
         mentions=("bad_timeout", "timeout")),
    Case("score-file-reward-hangs", ["score", "data={completions}", "reward={tmp}/r.py:hangs", "output={tmp}/o.jsonl"],
         ERROR, setup=with_rewards, mentions=("r.py:hangs", "did not return")),  # was: hung forever
    Case("score-file-reward-sys-exit", ["score", "data={completions}", "reward={tmp}/r.py:exits", "output={tmp}/o.jsonl"],
         ERROR, setup=with_rewards, mentions=("r.py:exits", "sys.exit")),
    # ---- agentic: user environments that follow the documented protocol
    Case("rl-env-without-tools", [*BASE, "env={tmp}/envs.py:Echo", "agent.max_turns=1"], WORKS, setup=with_envs,
         check=ran("grpo")),
    Case("rl-env-reset-returns-string", [*BASE, "env={tmp}/envs.py:Stringy", "agent.max_turns=1"], WORKS,
         setup=with_envs, check=ran("grpo")),
    Case("rl-env-reset-returns-number", [*BASE, "env={tmp}/envs.py:Number"], ERROR, setup=with_envs,
         mentions=("reset", "must return")),
    Case("rl-env-missing-file", [*BASE, "env={tmp}/nope.py:Echo"], ERROR, mentions=("nope.py",)),
    Case("rl-env-missing-class", [*BASE, "env={tmp}/envs.py:Echoo"], ERROR, setup=with_envs, mentions=("Echoo",)),
    # ---- quickstart: nothing deleted or reused before the inputs are checked
    Case("quickstart-fresh-model-typo-keeps-folder",  # was: the folder was deleted, then the typo refused
         [*QUICKSTART, "model=tiny-randmo", "fresh=true", "output_dir={tmp}/mine"], ERROR, setup=precious_folder,
         mentions=("tiny-randmo",), keep=("{tmp}/mine",)),
    Case("quickstart-fresh-refuses-foreign-folder", [*QUICKSTART, "fresh=true", "output_dir={tmp}/mine"], ERROR,
         setup=precious_folder, mentions=("fresh=true", "thesis.txt"), keep=("{tmp}/mine",)),
    Case("quickstart-data-typo", [*QUICKSTART, "rl.data={tmp}/nope.jsonl", "output_dir={tmp}/qs"], ERROR,
         mentions=("nope.jsonl",)),
    Case("quickstart-changed-rl-key", [*QUICKSTART, "rl.optim.lr=1e-3", "output_dir={tmp}/qs"], ERROR,
         setup=finished_quickstart_rl, mentions=("rl.optim.lr", "fresh=true"), keep=("{tmp}/qs",)),  # was: reused
    Case("quickstart-output-dir-is-file", [*QUICKSTART, "output_dir={tmp}/f"], ERROR, setup=write("f", "x"),
         mentions=("output_dir", "is a file")),
]

for _case in CASES:  # a check written as an expression (a lambda) fails when it is False
    _case.check = asserting(_case.check)


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_case(case, workspace, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    classify(case, workspace, tmp_path)
