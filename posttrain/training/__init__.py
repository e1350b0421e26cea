"""Training utilities shared by the recipes (layer between `posttrain.systems` and `posttrain.recipes`).

- `optim`: OptimSettings, build_optimizer, lr_factor / warmup_steps, optimizer_step (clip, step, schedule)
- `data_order`: EpochSampler, the deterministic resumable data order
- `run`: setup_run (output_dir, config.yaml), seed_everything, progress (the tqdm bar), init_ranks
- `lifecycle`: RunLifecycle (resume, metrics, checkpoints, final model, summary and report)
- `loop`: run_loop, the step loop (bar, checkpoints, fault injection, alarm stops) and CheckpointArgs
- `plan`: what a recipe asks the planner about its run (predict_run, planned_tokens) and measured_plan
- `settings`: derive, a config built from another recipe's (every shared field copied)

Nothing here imports a recipe.
"""
