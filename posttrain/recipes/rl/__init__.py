"""The RL wing: online RL with PPO and the group-baseline family, and online DPO.

`posttrain.recipes.rl.train(cfg)` runs what `posttrain rl` runs; the names below are its public API.
"""

from posttrain.recipes.rl.config import RLConfig, SystemsSettings
from posttrain.recipes.rl.step import (
    RLRun,
    build_reward,
    checkpoint_state,
    collect,
    finish,
    log_step,
    main,
    merge_metrics,
    optimizer_step,
    rl_step,
    run_steps,
    setup,
    train,
    update,
)

__all__ = ["RLConfig", "RLRun", "SystemsSettings", "build_reward", "checkpoint_state", "collect", "finish",
           "log_step", "main", "merge_metrics", "optimizer_step", "rl_step", "run_steps", "setup", "train", "update"]
