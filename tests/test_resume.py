"""Kill and resume, every training recipe: a run whose process exits abruptly after step 3
(`POSTTRAIN_FAIL_AT=0:3`, posttrain/systems/faults.py, called by posttrain.training.loop.run_loop after
each step's checkpoint; checkpoints every 2 steps, so step 3 is lost and redone) and is then resumed with
resume=true logs the same metrics (timing aside) and ends with the same weights as an uninterrupted run.

rs and sequence distillation run the SFT recipe inside: the kill lands in that SFT (rs: round 1 of 2).
rl (grpo with an adaptive β, ppo with its value model, online DPO with reference updates, grpo with ProRL's
reference reset and adaptive entropy control) is killed the same way; async RL's resume is in tests/test_async_rl.py, a torchrun rank's in tests/test_fsdp.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import COUNT_PROMPTS, write_jsonl
from posttrain import cli
from posttrain.systems.faults import EXIT_CODE
from preference_synthetic import rule_pairs

ROOT = Path(__file__).resolve().parents[1]
CUT = ["max_steps=4", "save_every=2"]  # checkpoints at 2 and 4; killed after 3
REWARD = """
def space_share(prompts, completions, **kw):
    return [c.count(" ") / max(len(c), 1) for c in completions]
"""


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A tiny teacher: tiny-random's architecture and tokenizer, other weights (seed 1)."""
    from posttrain.models.builtin import build_tiny
    from posttrain.models.loading import load_tokenizer

    path = tmp_path_factory.mktemp("teacher")
    build_tiny("tiny-random", seed=1).save_pretrained(path)
    load_tokenizer("tiny-random").save_pretrained(path)
    return str(path)


def case(name: str, tmp_path: Path, teacher: str) -> tuple[list[str], list[str], list[str]]:
    """(argv without output_dir, metrics files to compare, weight files to compare), relative to the run."""
    prefs = lambda: write_jsonl(tmp_path / "pairs.jsonl", rule_pairs(24))
    prompts = lambda: write_jsonl(tmp_path / "prompts.jsonl", COUNT_PROMPTS[:4])
    tiny = ["model=tiny-random", "progress=false"]
    (tmp_path / "reward.py").write_text(REWARD)  # a file reward: the killed run, another process, loads it by path
    reward = f"reward={tmp_path / 'reward.py'}:space_share"
    final = ["final/model.safetensors"]
    if name == "sft":
        return (["sft", *tiny, *CUT, "data=arithmetic:20", "batch_size=4", "micro_batch_size=2", "max_length=128",
                 "eval_every=2", "eval_fraction=0.2", "sample_every=1", "sample_max_tokens=4", "optim.lr=3e-3"],
                ["metrics.jsonl", "samples.jsonl"], final)
    if name == "rm":
        return (["rm", *tiny, *CUT, f"data={prefs()}", "batch_size=4", "eval_every=2", "eval_fraction=0.25",
                 "optim.lr=3e-3"], ["metrics.jsonl"], final)
    if name == "dpo":
        return (["dpo", *tiny, *CUT, f"data={prefs()}", "batch_size=4", "eval_every=2", "eval_fraction=0.25",
                 "optim.lr=1e-3", "length_probe.prompts=2", "length_probe.max_new_tokens=4"], ["metrics.jsonl"], final)
    if name == "kto":  # unpaired: the reference point z0 from mismatched pairs of each batch
        return (["dpo", *tiny, *CUT, f"data={prefs()}", "loss=kto", "batch_size=4", "eval_every=2",
                 "eval_fraction=0.25", "optim.lr=1e-3", "length_probe.prompts=0"], ["metrics.jsonl"], final)
    distill = ["distill", *tiny, *CUT, f"teacher={teacher}"]
    if name == "distill_logit":  # its own cache: the killed run builds it, the resumed one reads it
        return ([*distill, "mode=logit", "data=arithmetic:6", "packing=false", "batch_size=3", "micro_batch_size=2",
                 "top_k=8", "optim.lr=1e-3", "cache_dir=CACHE"], ["metrics.jsonl"], final)
    if name == "distill_on_policy":
        return ([*distill, "mode=on_policy", f"data={prompts()}", "prompts_per_step=2", "group_size=2",
                 "max_new_tokens=4", "optim.lr=1e-3", reward, "rl_weight=0.5", "algo=rloo", "samples_per_log=2"],
                ["metrics.jsonl", "samples.jsonl"], final)
    if name == "distill_sequence":  # the kill lands in the student's SFT (sft/)
        return ([*distill, "mode=sequence", f"data={prompts()}", "n=2", "max_new_tokens=4", "ignore_eos=true",
                 "keep_truncated=true", "batch_size=2", "micro_batch_size=1", "optim.lr=1e-3"],
                ["metrics.jsonl", "sft/metrics.jsonl"], ["sft/final/model.safetensors"])
    if name == "rs":  # killed in round 1's SFT; the resumed run finishes it, then round 2 and the final sampling
        return (["rs", *tiny, f"data={prompts()}", reward, "n=2", "max_new_tokens=4",
                 "keep_truncated=true", "rounds=2", "train.max_steps=4", "train.save_every=2", "train.batch_size=2",
                 "train.micro_batch_size=1", "train.optim.lr=1e-3", "train.forgetting_probe=false"],
                ["metrics.jsonl", "round-1/sft/metrics.jsonl", "round-2/sft/metrics.jsonl"],
                ["round-1/sft/final/model.safetensors", "round-2/sft/final/model.safetensors"])
    rl = ["rl", *tiny, *CUT, f"data={prompts()}", reward, "prompts_per_step=2", "group_size=4", "max_new_tokens=6",
          "optim.lr=1e-3", "samples_per_log=2"]
    if name == "rl_grpo":  # β > 0 with an adaptive KL controller: the reference and β resume too
        return [*rl, "algo=grpo", "beta=0.05", "kl_target=0.01"], ["metrics.jsonl", "samples.jsonl"], final
    if name == "rl_grpo_beta0":  # no reference: the KL-to-start probe set (step 1's samples) resumes
        return [*rl, "algo=grpo", "beta=0", "kl_probe_every=1"], ["metrics.jsonl", "samples.jsonl"], final
    if name == "rl_ppo":  # the value model, its optimizer and schedule resume (checkpoints/step-N/value/)
        return ([*rl, "algo=ppo", "critic_lr=1e-3"], ["metrics.jsonl", "samples.jsonl"],
                [*final, "final/value/model.safetensors"])
    if name == "rl_ref_reset":  # ProRL's reference reset (+ optimizer state) at step 2, adaptive entropy control
        return ([*rl, "algo=grpo", "beta=0.05", "ref_reset_every=2", "ref_reset_optimizer=true",
                 "entropy_control=adaptive", "entropy_coef=0.01", "entropy_target=50"], ["metrics.jsonl", "samples.jsonl"], final)
    if name == "rl_online_dpo":  # its own step; the reference copied from the policy every 2 steps
        return [*rl, "algo=online_dpo", "ref_update_every=2"], ["metrics.jsonl", "samples.jsonl"], final
    raise KeyError(name)


def with_dir(argv: list[str], out: Path) -> list[str]:
    return [a.replace("CACHE", str(out / "teacher-cache")) for a in argv] + [f"output_dir={out}"]


def in_process(argv: list[str]) -> None:
    assert cli.main(argv) == 0


def ignored(key: str) -> bool:
    """Timing, and the flag of a resumed sequence distillation that its teacher's samples were reused."""
    return key.startswith("time/") or key.endswith(("seconds", "_per_s")) or key == "teacher/reused"


def rows(path: Path) -> list[str]:
    """Each line without its ignored keys, as canonical JSON (NaN compares equal to NaN)."""
    out = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        out.append(json.dumps({k: v for k, v in row.items() if not ignored(k)}, sort_keys=True))
    return out


@pytest.mark.parametrize("name", ["sft", "rm", "dpo", "kto", "distill_logit", "distill_on_policy", "distill_sequence",
                                  "rs", "rl_grpo", "rl_grpo_beta0", "rl_ppo", "rl_online_dpo", "rl_ref_reset"])
def test_a_killed_run_resumes_to_the_uninterrupted_run(tmp_path, teacher_dir, name):
    argv, logs, weights = case(name, tmp_path, teacher_dir)
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    in_process(with_dir(argv, straight))

    env = {**os.environ, "POSTTRAIN_FAIL_AT": "0:3", "POSTTRAIN_NO_PROGRESS": "1"}
    killed = subprocess.run([sys.executable, "-m", "posttrain", *with_dir(argv, cut)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == EXIT_CODE, killed.stderr[-3000:]
    assert list(cut.rglob(".failed-rank0-step3")), "the run was not killed after step 3"
    assert not any((cut / w).exists() for w in weights), "the killed run got to its final weights"
    in_process(with_dir(argv, cut) + ["resume=true"])

    for log in logs:
        assert rows(cut / log) == rows(straight / log), log
    for w in weights:
        a, b = load_file(straight / w), load_file(cut / w)
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a), w
