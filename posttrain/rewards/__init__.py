"""Reward sources for RL (docs/rewards.md): verifiers (math, code sandbox, format), language consistency,
length shaping, weighted composition, one TRL-compatible signature for all.

    from posttrain.rewards import registry
    reward = registry.compose("math:1.0,format:0.2")
    scores = reward(prompts, completions, answer=answers)
"""
