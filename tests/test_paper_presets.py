"""Each `algo=` preset against its paper's table of settings, as the command line resolves it (advantage,
policy loss and its clip ranges, aggregation, β and the KL's place, dynamic sampling, overlong shaping,
epochs); `--show-preset` prints the preset without loading anything, and docs/algorithms.md carries its output."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.algos import policy_losses
from posttrain.algos.kl import BETA_PRESETS
from posttrain.algos.presets import RL_PRESETS, describe_preset
from posttrain.config import ConfigError, parse_args
from posttrain.recipes import rl
from posttrain.recipes.rl.loop import show_preset
from posttrain.rewards.build import build_reward
from posttrain.rewards.shaping import overlong_defaults

ROOT = Path(__file__).resolve().parents[1]

# The papers' settings, written from the papers (not from presets.py). eps: (low, high) clip range of the ratio
# (None: no bound); kl: where the KL sits. Settings that are batch sizes (prompts, samples per prompt) or a
# learning rate are the run's, not the algorithm's, and are not part of a preset.
PAPERS = {
    # DeepSeekMath §4.1.2 / §4.2: group-normalised outcome advantage, PPO clip, 1/|o_i| per sequence then mean over
    # the group, KL (unbiased estimator, eq. 4 = k3) in the loss with β = 0.04, one update per exploration stage
    "grpo": dict(advantage="grpo", std_scale="group", loss="ppo", eps=(0.2, 0.2), agg="seq_mean_token_mean",
                 beta=0.04, kl="loss", dynamic=False, overlong=False, epochs=1),
    # Liu et al. 2025 (Dr. GRPO): no std normalisation, no 1/|o_i| (a constant), no KL
    "dr_grpo": dict(advantage="dr_grpo", loss="ppo", eps=(0.2, 0.2), agg="seq_mean_token_sum_norm", beta=0.0,
                    kl="none", dynamic=False, overlong=False, epochs=1),
    # Yu et al. 2025 (DAPO) §3, Algorithm 1: clip-higher ε_low 0.2 / ε_high 0.28, dynamic sampling, token-level
    # loss, soft overlong punishment (Lmax 20480, Lcache 4096), KL removed
    "dapo": dict(advantage="grpo", std_scale="group", loss="clip_higher", eps=(0.2, 0.28), agg="token_mean",
                 beta=0.0, kl="none", dynamic=True, overlong=True, epochs=1),
    # Zheng et al. 2025 (GSPO): sequence-level ratio, clip 3e-4 / 4e-4, group advantages, no KL
    "gspo": dict(advantage="grpo", std_scale="group", loss="gspo", eps=(3e-4, 4e-4), agg="seq_mean_token_mean",
                 beta=0.0, kl="none", dynamic=False, overlong=False, epochs=1),
    # MiniMax-M1 §3.1 (CISPO): clipped IS weight with no lower bound, token-level normalisation, group advantages
    "cispo": dict(advantage="grpo", std_scale="group", loss="cispo", eps=(None, 0.28), agg="token_mean", beta=0.0,
                  kl="none", dynamic=False, overlong=False, epochs=1),
    # Ahmadian et al. 2024: leave-one-out baseline, REINFORCE (on-policy: the ratio stays 1)
    "rloo": dict(advantage="rloo", loss="ppo", eps=(0.2, 0.2), agg="token_mean", beta=0.0, kl="none",
                 dynamic=False, overlong=False, epochs=1),
    # Hu 2025 (REINFORCE++) eq. 10: batch normalisation over the batch's tokens, PPO clip 0.2
    "reinforce_pp": dict(advantage="reinforce_pp", whiten="token", loss="ppo", eps=(0.2, 0.2), agg="token_mean",
                         beta=0.0, kl="none", dynamic=False, overlong=False, epochs=1),
    # InstructGPT / PPO: GAE (γ 1, λ 0.95), clip 0.2, k1 KL in the reward with β = 0.02, several epochs per batch
    "ppo": dict(advantage="gae", loss="ppo", eps=(0.2, 0.2), agg="token_mean", beta=0.02, kl="reward",
                dynamic=False, overlong=False, epochs=2),
}


def loss_clip(name: str, loss_args: dict) -> tuple:
    """(ε_low, ε_high) a policy loss uses with these arguments (its signature's defaults otherwise)."""
    params = {k: p.default for k, p in inspect.signature(policy_losses.get(name)).parameters.items()}
    params.update(loss_args)
    if name in ("ppo", "dual_clip"):
        eps = params["eps"]
        return (params["eps_low"] if params["eps_low"] is not None else eps,
                params["eps_high"] if params["eps_high"] is not None else eps)
    return params["eps_low"], params["eps_high"]


def estimator_default(name: str, option: str):
    from posttrain.algos import advantages

    return inspect.signature(advantages.get(name)).parameters[option].default


@pytest.mark.parametrize("algo", sorted(PAPERS))
def test_preset_equals_its_papers_settings(algo):
    paper = PAPERS[algo]
    cfg = parse_args(rl.RLConfig, [f"algo={algo}", "max_new_tokens=40"])
    assert cfg.resolved_advantage == paper["advantage"]
    for option in ("std_scale", "whiten"):
        if option in paper:
            assert estimator_default(paper["advantage"], option) == paper[option]
    assert cfg.resolved_loss == paper["loss"]
    assert loss_clip(cfg.resolved_loss, cfg.loss_args) == pytest.approx(paper["eps"])
    assert cfg.resolved_agg == paper["agg"]
    assert cfg.resolved_beta == paper["beta"]
    assert cfg.needs_reference == (paper["kl"] != "none")
    assert (RL_PRESETS[algo].advantage == "gae") == (paper["kl"] == "reward")  # PPO: k1 in the token reward
    assert cfg.resolved_dynamic_sampling == paper["dynamic"]
    assert cfg.resolved_overlong == paper["overlong"]
    assert ("overlong" in cfg.resolved_reward) == paper["overlong"]
    assert cfg.epochs == paper["epochs"]


def test_dapo_overlong_shaping_follows_max_new_tokens():
    """DAPO eq. 13 with Lmax = max_new_tokens and Lcache = Lmax / 5 (the paper: 20480 and 4096, the same 1/5):
    0 up to Lmax − Lcache, then linear to −1 at Lmax."""
    cfg = parse_args(rl.RLConfig, ["algo=dapo", "max_new_tokens=20"])
    assert cfg.resolved_reward == "math,overlong"
    assert overlong_defaults(20480) == {"max_len": 20480, "cache_len": 4096}
    from posttrain.data.formats import Row

    rows = [Row({"prompt": "q", "answer": "4"}, "mem", 0)]
    reward = build_reward(cfg.resolved_reward, cfg.reward_args, rows, cfg.sampling.max_new_tokens)
    completions = ["4"] * 4
    ids = [[1] * 16, [1] * 18, [1] * 20, [1] * 12]  # Lmax 20, Lcache 4: soft zone 16 < L <= 20
    scores = reward(["q"] * 4, completions, answer=["4"] * 4, completion_ids=ids)
    assert scores == pytest.approx([1.0, 1.0 - 0.5, 1.0 - 1.0, 1.0])
    # named by hand, or turned off: not added twice / not at all
    assert parse_args(rl.RLConfig, ["algo=dapo", "reward=math,overlong:0.5"]).resolved_reward == "math,overlong:0.5"
    assert parse_args(rl.RLConfig, ["algo=dapo", "overlong_shaping=false"]).resolved_reward == "math"
    assert parse_args(rl.RLConfig, ["algo=grpo", "overlong_shaping=true"]).resolved_reward == "math,overlong"


def test_beta_by_paper_name():
    for name, value in {"instructgpt": 0.02, "llama2": 0.01, "deepseekmath": 0.04, "tulu3": 0.05, "dapo": 0.0}.items():
        assert parse_args(rl.RLConfig, [f"beta={name}"]).resolved_beta == value == BETA_PRESETS[name]
    assert parse_args(rl.RLConfig, ["beta=0.3"]).resolved_beta == 0.3
    with pytest.raises(ConfigError, match=r"beta must be a number >= 0 or a preset name: instructgpt \(0.02\)"):
        parse_args(rl.RLConfig, ["beta=llama3"])
    with pytest.raises(ConfigError, match="beta: Input should be greater than or equal to 0"):
        parse_args(rl.RLConfig, ["beta=-0.1"])
    with pytest.raises(ConfigError, match="beta"):
        parse_args(rl.RLConfig, ["beta=[0.1]"])


def test_show_preset_prints_the_preset_without_loading_a_model():
    out = subprocess.run([sys.executable, "-m", "posttrain", "rl", "algo=dapo", "max_new_tokens=512", "--show-preset"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("algo=dapo: Yu et al. 2025, DAPO\n")
    assert "clip_higher (eps_low=0.2, eps_high=0.28)" in out.stdout
    assert "dynamic sampling on" in out.stdout and "overlong shaping on" in out.stdout
    assert "reward=math,overlong, max_new_tokens=512" in out.stdout
    assert "torch" not in out.stderr  # nothing loaded, nothing warned


def test_show_preset_reflects_overrides():
    cfg = parse_args(rl.RLConfig, ["algo=reinforce_pp", "advantage_args={whiten: sequence}", "beta=llama2"])
    text = show_preset(cfg)
    assert "reinforce_pp (whiten='token'" in text  # the preset
    assert "advantage=reinforce_pp {'whiten': 'sequence'}" in text and "beta=0.01" in text  # this command line


@pytest.mark.parametrize("algo", sorted(RL_PRESETS))
def test_docs_carry_each_presets_show_preset_output(algo):
    assert describe_preset(algo) in (ROOT / "docs" / "algorithms.md").read_text(), (
        f"docs/algorithms.md: paste `posttrain rl algo={algo} --show-preset`'s preset block")


def test_dapo_run_adds_the_overlong_reward(tmp_path):
    """algo=dapo on the tiny model: the composed reward has the overlong part, scored in tokens against
    max_new_tokens (samples forced to the limit: L = Lmax, penalty −1 each)."""
    from conftest import COUNT_PROMPTS, write_jsonl
    from posttrain.rewards.base import register

    @register("space_frac_dapo", description="test reward: share of spaces")
    def space_frac_dapo(prompts, completions, **kw):
        return [c.count(" ") / max(len(c), 1) for c in completions]

    data = write_jsonl(tmp_path / "prompts.jsonl", COUNT_PROMPTS)
    cfg = parse_args(rl.RLConfig, ["model=tiny-random", f"data={data}", f"output_dir={tmp_path / 'run'}", "algo=dapo",
                                   "reward=space_frac_dapo", "prompts_per_step=2", "group_size=4", "max_new_tokens=5",
                                   "ignore_eos=true", "max_resample=0", "max_steps=1", "progress=false"])
    run = rl.setup(cfg)
    assert [name for name, _ in run.reward_fn.parts] == ["space_frac_dapo", "overlong"]
    row = rl.rl_step(run, 0)
    run.rollout.close()
    assert row["rewards/overlong/mean"] == -1.0 and row["rewards/overlong/std"] == 0.0
