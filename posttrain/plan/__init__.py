"""The cost planner (docs/planner.md): predict memory, tokens, FLOPs and time of a method before running it.

    from posttrain.plan import predict
    predict("llama-3-8b", "ppo")["memory_bytes_total"]   # 288e9-ish: 128 + 128 + 16 + 16 GB

Modules: `arch` (parameters total and active, LoRA, KV from a config, per decoder family), `resolve` (a model given
any way -> its counts: a known family, the model object, a meta-device build, safetensors headers, the weight index),
`cost` (the formulas), `methods` (models and passes per method, the table of `posttrain methods`), `predict` (one plan
as a dict; what cannot be predicted is in its `notes` and `unknown`, never an error), `report` (the table), `measure`
(what a run records next to its prediction in `plan.json`), `cpu` (hardware=cpu), `cli` (`posttrain plan`).
"""

from posttrain.plan.predict import predict, predict_config, resolve_model

__all__ = ["predict", "predict_config", "resolve_model"]
