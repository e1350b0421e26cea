"""Forward passes shared by every recipe: token log-probs at loss positions only.

The backbone runs once; lm_head + log-softmax run only at positions whose target is not IGNORE,
in chunks (ops.logprobs), so a packed row of 4k tokens with 30% prompt never builds prompt logits.
"""

from __future__ import annotations

import contextlib

import torch

from posttrain.data.packing import IGNORE, Batch
from posttrain.ops.attention import NAME as VARLEN
from posttrain.ops.attention import segments_from_positions
from posttrain.ops.logprobs import chunked_logprobs


def unwrap(model):
    """The transformers CausalLM under a PEFT wrapper (LoRA layers stay in place inside it)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def backbone_and_head(model):
    inner = unwrap(model)
    return getattr(inner, inner.base_model_prefix), inner.get_output_embeddings()


MIXED_PRECISION = ("none", "bf16")


def compute_precision(mixed_precision: str, device) -> contextlib.AbstractContextManager:
    """The context the backbone runs in. 'bf16': torch.autocast -- matmuls (forward and backward) in
    bfloat16 with fp32 accumulation (AMX on recent Xeons, tensor cores on GPUs) while weights,
    gradients and optimizer state stay in their own dtype; 'none': everything in the weights' dtype."""
    if mixed_precision == "none":
        return contextlib.nullcontext()
    if mixed_precision == "bf16":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    raise ValueError(f"mixed_precision must be one of {MIXED_PRECISION}, not {mixed_precision!r}")


def hidden_states(model, batch: Batch, mixed_precision: str = "none", layout=None) -> torch.Tensor:
    """Last hidden states (B, T, H) of the decoder for a packed or padded batch.

    `layout` (ops.attention.Layout, per row its shared-prefix blocks) replaces the segments derived
    from the position ids: a group's prompt runs once and its completions attend to it.

    Under mixed precision the residual stream and the final norm stay fp32 (fp32 embeddings + bf16
    matmul outputs promote to fp32), so the returned states are fp32."""
    backbone, _ = backbone_and_head(model)
    extra = {}
    if getattr(unwrap(model).config, "_attn_implementation", None) == VARLEN:
        if layout is not None:
            extra["layout"] = layout
        else:
            extra["segments"] = segments_from_positions(batch.position_ids, batch.row_tokens)  # per-sample causal attention
    elif layout is not None:
        raise ValueError("a shared-prefix layout needs posttrain's varlen attention (load_model(varlen_attention=True))")
    with compute_precision(mixed_precision, batch.input_ids.device):
        out = backbone(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            attention_mask=batch.attention_mask,
            use_cache=False,
            **extra,
        )
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def token_logprobs(model, batch: Batch, temperature: float = 1.0, with_entropy: bool = False, chunk: int = 1024,
                   mixed_precision: str = "none"):
    """log p(target) at every loss position, flattened in row-major order: (M,), entropy (M,) | None.

    lm_head + log-softmax always run in the head's own dtype (fp32 for fp32 weights), also under
    mixed precision: bf16 logits would err by ~0.1 nat at |z| ~ 20."""
    _, head = backbone_and_head(model)
    h = hidden_states(model, batch, mixed_precision)
    sel = batch.targets != IGNORE  # (B, T)
    return chunked_logprobs(
        h[sel], head.weight, batch.targets[sel], bias=head.bias,
        temperature=temperature, chunk=chunk, with_entropy=with_entropy,
    )
