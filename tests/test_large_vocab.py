"""An RL update's memory does not grow with the vocabulary beyond weights, AdamW moments and gradients.

benchmarks/large_vocab_memory.py measures the resident-set peak of each phase of an RL update (the
reference's log-probs; per micro-batch the policy's log-probs + entropy + GRPO loss with a KL term,
and its backward) on tiny-random-qwen3 (tied embedding / lm_head, as Gemma 3) at V = 1024 and at
Gemma 3's V = 262,144 (256x), 8 samples of 64 tokens. "Transient" is the peak beyond the memory
every update holds anyway: weights and moments (held before the phase starts) and the gradients a
backward necessarily holds at once (one dense gradient per parameter, twice the tied matrix). Those
grow with V by 256x; the transients must grow by less than 2x. The log-prob head computed
(384 x 262,144) logits at once before (forward peak 1.16 GB, 124x the small vocabulary's); in tiles
it stays at ~7.5 MB.
"""

import large_vocab_memory  # benchmarks/ (on the path through conftest.py)

SMALL, LARGE = 1024, 262144


def test_rl_update_memory_does_not_grow_with_the_vocabulary():
    small, large = large_vocab_memory.run_cases("tiny-random-qwen3", [SMALL, LARGE])
    assert large["weights"] > 100 * small["weights"]  # the vocabulary matrix dominates: the weights grew ~120x
    for key in ("reference", "forward0", "transient0", "forward1", "transient1"):
        assert small[key] > 2**20, (key, small[key])  # the small vocabulary's phase does allocate (MBs of activations)
        assert large[key] < 2 * small[key], f"{key}: {large[key] / 2**20:.1f} MiB at V={LARGE}, {small[key] / 2**20:.1f} at V={SMALL}"
