"""Mechanisms for running training on more than one process, and for saving and resuming it.

- `dist`: ranks and process groups (DistInfo, init_from_env, rank_device) and what the ranks share
  (rank_share, global_sum, gather_objects, barrier)
- `fsdp`: FSDP2 sharding (Sharded, apply, shard_model), the full weights of a sharded model (full_state,
  save_full), distributed checkpoints (save_dcp, load_dcp)
- `checkpoint`: the run's checkpoints (weights, optimizer, scheduler, RNG, state; DCP when sharded)
- `faults`: fault injection for the restart tests (POSTTRAIN_FAIL_AT)

The rule: mechanisms only. Nothing here imports a recipe or `posttrain.training` (both sit above this
layer); a recipe's sharded step is its one step (rank_share hands one process every micro-batch;
recipes/sft.py, recipes/rl/step.py and recipes/rl/sharded.py).
"""
