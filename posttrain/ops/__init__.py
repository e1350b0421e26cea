"""Tensor kernels (layer 1, imports nothing else from the project): log-probs of chosen tokens without
full logits (`logprobs`), the one sampling function the engine and the trainer share (`sampling`), masked
reductions (`masked`), varlen attention over packed rows (`attention`), the engine's fused CPU kernels
(`cpu_kernels`, sources in csrc/), one gradient buffer for a tied embedding (`tied`) and host-memory tuning
(`host_memory`).
"""
