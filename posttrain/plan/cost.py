"""The cost model's formulas, as pure functions of numbers (derived in docs/planner.md).

Units: bytes, FLOPs, seconds, nats. GB = 1e9 bytes (the seeds' 288 GB), GiB/TiB = 2^30/2^40 (KV sizes).
"""

from __future__ import annotations

import math

from posttrain.errors import UserError

# Bytes per value of a dtype name (weights of frozen models, KV cache, activations).
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1, "int8": 1, "int4": 0.5}

# Training state per trainable parameter with Adam: mixed precision = bf16 weight 2 + bf16 grad 2 +
# fp32 master weight 4 + Adam m and v 8 = 16; pure fp32 = weight 4 + grad 4 + m, v 8 = 16 as well.
TRAIN_BYTES_PER_PARAM = 16

# Named accelerators: dense BF16 peak FLOP/s (no sparsity) and memory per device in bytes.
HARDWARE = {
    "h100": (989e12, 80e9),  # H100 SXM
    "h200": (989e12, 141e9),
    "a100": (312e12, 80e9),
    "b200": (2250e12, 192e9),
}
# Their memory bandwidth in bytes/s (HBM): what a decode step's weight and KV reads are divided by.
BANDWIDTH = {"h100": 3.35e12, "h200": 4.8e12, "a100": 2.039e12, "b200": 8e12}


def dtype_bytes(name: str, key: str = "dtype") -> float:
    if name not in DTYPE_BYTES:
        raise UserError(f"{key}: unknown dtype '{name}'; use one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


# ---------------------------------------------------------------------------- memory


def model_bytes(params: float, trainable: float, train_bytes: float = TRAIN_BYTES_PER_PARAM, infer_bytes: float = 2) -> float:
    """Frozen parameters at inference bytes, trainable ones at training bytes:
    (params − trainable)·infer + trainable·train. Full training: 16·N; frozen: 2·N; LoRA: 2·N_base + 16·N_lora."""
    return (params - trainable) * infer_bytes + trainable * train_bytes


def activation_bytes(tokens: int, layers: int, hidden: int, intermediate: int, kv_dim: int, vocab: int,
                     bytes_per_value: float = 4, logit_copies: float = 3, heads: int = 0, seq_len: int = 0,
                     checkpointing: bool = False, layer_values: float | None = None, layer_max: float | None = None) -> float:
    """Activations kept for backward in one forward/backward over `tokens` tokens:

        no checkpointing   bytes × tokens × [ L·A + 3h + copies·V ],   A = 8h + 4i + 2·kv_dim (+ a·s)
        checkpointing      bytes × tokens × [ L·h + A_max + 3h + copies·V ]

    A (values per token in one layer) was counted with torch's saved-tensor hooks on the transformers
    Llama/Qwen2 decoder (SDPA attention, fp32): 8h (two RMSNorm inputs and outputs, q, rotated q, k/v
    expanded to all heads, attention output), 4i (gate, SiLU, up, their product), 2·kv_dim (k before and
    after RoPE); other families pass their own `layer_values` (mean over layers) and `layer_max`
    (Arch.activation_values_per_token). 3h after the last layer (final norm); the loss keeps `logit_copies`
    (tokens × V) tensors alive at once — 3 for the HF loss (logits, log-softmax, its gradient), 1 with a
    chunked selective log-softmax. Eager attention also stores the a×s probabilities per token per layer:
    pass heads and seq_len for that term. Gradient checkpointing keeps only each layer's input (h per
    token per layer) and recomputes one layer at a time in backward, whose A_max values are alive then.
    """
    mean = layer_values if layer_values is not None else 8 * hidden + 4 * intermediate + 2 * kv_dim
    largest = layer_max if layer_max is not None else mean
    probs = heads * seq_len  # eager attention's probabilities, per token per layer
    kept = layers * hidden + largest + probs if checkpointing else layers * (mean + probs)
    return bytes_per_value * tokens * (kept + 3 * hidden + logit_copies * vocab)


def optimizer_temp_bytes(trainable: float) -> float:
    """torch AdamW (foreach) allocates sqrt(v) for every parameter during `step()`: 4 bytes per trainable param."""
    return 4 * trainable


# ---------------------------------------------------------------------------- FLOPs and time


def train_flops_per_param(trainable_fraction: float = 1.0, checkpointing: bool = False) -> float:
    """Forward 2 + backward 4 = 6 per parameter per token (Kaplan 2020). Backward = activation gradients 2 +
    weight gradients 2; frozen weights (LoRA) skip theirs: 4 + 2·(trainable fraction). Gradient
    checkpointing runs the forward once more in backward: + 2 (full fine-tuning 8; LoRA 6 + 2·fraction)."""
    return 4 + 2 * trainable_fraction + (2 if checkpointing else 0)


def seconds(flops: float, peak_flops: float, mfu: float, devices: int = 1) -> float:
    """Wall time = FLOPs / (devices × peak × MFU)."""
    return flops / (devices * peak_flops * mfu)


# ---------------------------------------------------------------------------- KV cache, agents


def kv_bytes(kv_bytes_per_token: float, sequences: int, context: int) -> float:
    """KV cache with every sequence of a step in flight: per-token bytes × sequences × context length.
    Reasoning step 512 × 16 × 16K × 128 KiB (Llama-3-8B) = 2^44 B = 16 TiB."""
    return kv_bytes_per_token * sequences * context


def agent_trajectory(turns: int, gen_per_turn: int, return_per_turn: int, prompt_len: int = 0) -> dict:
    """Token accounting of one multi-turn trajectory (seed 002, 第六篇 and exercise A9).

    The environment answers every turn but the last, so the final context is
        C = prompt + T·g + (T − 1)·r            (10 × 400 + 9 × 3000 = 31K; 20 × 500 + 19 × 2000 = 48K)
    Only the T·g generated tokens carry loss; the backward pass still runs over all C, so the training cost
    per useful token, relative to single-turn training where every token is generated, is C / (T·g)
    (31000 / 4000 = 7.75×; 48000 / 10000 = 4.8 ≈ 5×), and the generated share is its inverse (13%, 21%).
    Prefill without a prefix cache re-reads the history before every turn: Σ_t [prompt + (t − 1)(g + r)]
    (20 turns: 475K ≈ the seed's 480K); with the cache every context token is prefilled once: C (48K).
    """
    context = prompt_len + turns * gen_per_turn + (turns - 1) * return_per_turn
    generated = turns * gen_per_turn
    no_cache = sum(prompt_len + (t - 1) * (gen_per_turn + return_per_turn) for t in range(1, turns + 1))
    return {
        "turns": turns,
        "context_tokens": context,
        "generated_tokens": generated,
        "generated_share": generated / context,
        "cost_per_useful_token": context / generated,
        "prefill_tokens_no_cache": no_cache,
        "prefill_tokens_prefix_cache": context,
    }


# ---------------------------------------------------------------------------- distillation, BoN, eval


def logit_bytes_per_token(vocab: int, top_k: int | None = None, value_bytes: float = 2, id_bytes: float = 2) -> float:
    """Teacher logits stored per position: full vocabulary V × value bytes (128K × 2 B = 256 KiB in BF16);
    top-k stores k × (id + log-prob) = 64 × (2 + 2) = 256 B (the seeds' figure). A 2-byte id only indexes
    65,536 tokens: for a larger vocabulary pass id_bytes=3 or 4 (64 × 6 = 384 B)."""
    if top_k is None:
        return vocab * value_bytes
    return top_k * (id_bytes + value_bytes)


def topk_cache_bytes_per_token(vocab: int, top_k: int, value_bytes: float = 2) -> float:
    """The teacher cache of `posttrain distill mode=logit`: top-k ids (2 bytes when the vocabulary fits in
    65,536 ids, else 4) and log-probs, plus one value for the tail mass Σ_{v∉top-k} P(v) that keeps the KL
    exact on the coarser partition: k × (id + value) + value = 64 × (2 + 2) + 2 = 258 B for SmolLM2."""
    id_bytes = 2 if vocab <= 2**16 else 4
    return logit_bytes_per_token(vocab, top_k, value_bytes, id_bytes) + value_bytes


def bon_kl(n: int) -> float:
    """KL(best-of-N ‖ base) ≤ log N − (N − 1)/N nats (an upper bound, Beirami et al. 2024).
    N = 4/16/64/256 → 0.64/1.83/3.17/4.55; K = 10 → 1.40, K = 30 → 2.43."""
    if n < 1:
        raise UserError(f"group: best-of-N needs N ≥ 1 (got {n})")
    return math.log(n) - (n - 1) / n


def ci95_half_width(p: float, n: int) -> float:
    """Half-width of the normal-approximation 95% interval of an accuracy p on n items: 1.96·sqrt(p(1−p)/n).
    p = 0.5: AIME 30 → ±17.9 points, 500 → ±4.4, 1000 → ±3.1, MMLU 14042 → ±0.83."""
    if n < 1:
        raise UserError(f"eval_n: needs at least 1 item (got {n})")
    if not 0 <= p <= 1:
        raise UserError(f"eval_p: accuracy must be in [0, 1] (got {p})")
    return 1.96 * math.sqrt(p * (1 - p) / n)
