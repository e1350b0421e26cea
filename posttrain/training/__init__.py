"""Training utilities shared by the recipes (layer between `posttrain.systems` and `posttrain.recipes`).

- `optim`: OptimSettings, build_optimizer, lr_factor / warmup_steps, optimizer_step (clip, step, schedule)
- `data_order`: EpochSampler, the deterministic resumable data order
- `run`: setup_run (output_dir, config.yaml), seed_everything, progress (the tqdm bar)
- `lifecycle`: RunLifecycle (resume, metrics, checkpoints, final model, summary and report)

Nothing here imports a recipe.
"""
