"""Distillation: `posttrain distill mode=logit | sequence | on_policy teacher=FOLDER model=STUDENT`.

    logit      the teacher's next-token distribution on fixed sequences (the data's assistant turns),
               stored once as a top-k cache with a tail bucket (cache.py), memory-mapped and reused
               across epochs and runs; the student minimises a divergence to it per loss token (classic
               KD, Hinton et al. 2015), optionally mixed with the data's NLL (`ce_weight`): logit.py.
    sequence   the teacher generates N completions per prompt (optionally filtered by a verifier), the
               student does SFT on them (Kim & Rush 2016); the rejection-sampling and SFT recipes do the
               work: sequence.py. Works across tokenizers.
    on_policy  GKD (Agarwal et al. 2024): the student samples, the teacher scores every sampled position,
               loss = forward KL, reverse KL or JSD(β) per token over the student's tokens, optionally
               mixed with the RL loss of a reward (`rl_weight`); the RL recipe's run does the sampling:
               on_policy.py.

Logit and on-policy modes need the same tokenizer: a mismatch is refused before any model loads,
naming the first token id that differs (teacher.py).

Modules, lowest first (each imports only those above it):
    config     DistillConfig, and sft_settings: the SFT recipe's config derived from it
    teacher    the teacher side: tokenizer checks, fingerprints, logits at loss positions, chunked
               backward, the planner's teacher and plan.json's teacher measurements
    cache      the top-k teacher cache of logit mode
    logit, sequence, on_policy   the three modes (each with its own train)
    main       train (dispatch on mode) and main (what `posttrain distill` calls)
"""

from posttrain.recipes.distill.config import DistillConfig, sft_settings
from posttrain.recipes.distill.main import main, train

__all__ = ["DistillConfig", "main", "sft_settings", "train"]
