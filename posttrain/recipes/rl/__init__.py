"""The RL wing: online RL with PPO and the group-baseline family (GRPO, Dr. GRPO, DAPO, GSPO, CISPO, RLOO,
REINFORCE++), and online DPO. `posttrain.recipes.rl.train(cfg)` runs what `posttrain rl` runs.

Modules, lowest first (each imports only those above it in this list):
    config      RLConfig and the async/Ray settings (SystemsSettings); every preset-derived default
    phases      the pieces of a step: generate, score, refill, advantages, log-probs, the loss
    ppo         Critic: PPO's value model, GAE, value loss, its checkpoints
    run         RLRun (the typed state of a run), the Rollout protocol, UpdateStats
    rollout     the synchronous sources; sharded, agentic, async_rl, ray_cluster: the other sources
                (torchrun ranks, multi-turn episodes, a producer thread or Ray actors)
    log         the metrics row of a step, alarms, samples
    step        rl_step: collect -> advantage -> reference -> [critic] -> update -> log
    online_dpo  online DPO's own step
    build       setup(): everything before the first step; the rollout source chosen once
    loop        train / run_steps / finish / main
"""

from posttrain.recipes.rl.build import setup
from posttrain.recipes.rl.config import RLConfig, SystemsSettings
from posttrain.recipes.rl.log import log_step, merge_metrics
from posttrain.recipes.rl.loop import checkpoint_args, checkpoint_state, finish, main, run_steps, train
from posttrain.recipes.rl.run import RLRun, UpdateStats
from posttrain.recipes.rl.step import rl_step, update

__all__ = ["RLConfig", "RLRun", "SystemsSettings", "UpdateStats", "checkpoint_args", "checkpoint_state", "finish", "log_step", "main",
           "merge_metrics", "rl_step", "run_steps", "setup", "train", "update"]
