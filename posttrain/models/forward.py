"""Forward passes shared by every recipe: token log-probs at loss positions only.

The backbone runs once; lm_head + log-softmax run only at positions whose target is not IGNORE,
in tiles (ops.logprobs), so a packed row of 4k tokens with 30% prompt never builds prompt logits.

The head is applied from its weight (`logit_head`), not through the model's forward, so what a
causal LM's forward does to its logits after lm_head must be reproduced here: Gemma 2's
final_logit_softcapping (z = c·tanh(z/c)), Cohere's logit_scale (z·s), Granite's logits_scaling
(z/s) are read from the config (`head_transform`). Any other post-processing would silently train
another distribution, so the first time a model's head is used it is checked against the model's
own forward on a few tokens (`check_logit_head`); a mismatch raises, naming what differs.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn.functional as F

from posttrain.data.packing import IGNORE, Batch
from posttrain.errors import UserError
from posttrain.ops.attention import NAME as VARLEN
from posttrain.ops.attention import segments_from_positions
from posttrain.ops.logprobs import HeadMap, LogitHead
from posttrain.ops.tied import tie_for


def unwrap(model):
    """The transformers CausalLM under a PEFT wrapper (LoRA layers stay in place inside it)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def backbone_of(model):
    """The decoder stack (embeddings, layers, final norm) of a causal LM."""
    inner = unwrap(model)
    return getattr(inner, inner.base_model_prefix)


def backbone_and_head(model) -> tuple[torch.nn.Module, LogitHead]:
    """(decoder stack, the model's logit head: weight, bias, scale, soft-cap; checked once per model)."""
    return backbone_of(model), logit_head(model)


def head_transform(config) -> tuple[float, float | None]:
    """(scale s, soft-cap c) such that the model's logits are c·tanh(s·lm_head(h)/c) (plain s·lm_head(h)
    without a cap), read from the config attributes transformers' causal LMs apply after lm_head."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = 1.0
    if getattr(config, "logit_scale", None) is not None:  # Cohere, Cohere2: logits * logit_scale
        scale *= float(config.logit_scale)
    if getattr(config, "logits_scaling", None) is not None:  # Granite: logits / logits_scaling
        scale /= float(config.logits_scaling)
    cap = getattr(config, "final_logit_softcapping", None)  # Gemma 2 (and others): tanh(z / c) * c
    return scale, (float(cap) if cap else None)


_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> True once its head matched


def logit_head(model) -> LogitHead:
    """The head of `model` as ops.logprobs applies it, with the tensors of this call (build one per forward).
    Where its weight is the input embeddings' (and ops.tied applies), it carries the forward's TiedGrad: pass
    `head.tie` to `hidden_states` so the two gradients share one buffer."""
    inner = unwrap(model)
    lm_head = inner.get_output_embeddings()
    if hasattr(lm_head, "base_layer"):  # a PEFT adapter on lm_head: its weight alone is not the head
        raise UserError(f"{type(inner).__name__}: an adapter on the output embeddings is not supported "
                        "(posttrain applies lm_head from its weight); leave lm_head out of the LoRA targets")
    scale, cap = head_transform(inner.config)
    head = LogitHead(lm_head.weight, getattr(lm_head, "bias", None), scale, cap,
                     tie_for(inner.get_input_embeddings(), lm_head.weight))
    if inner not in _checked:
        check_logit_head(inner, head)
        _checked[inner] = True
    return head


@torch.no_grad()
def check_logit_head(inner, head: LogitHead, tokens: int = 8) -> None:
    """Run the model's own forward on `tokens` fixed ids and check, on the tensors it computed, that
    (1) lm_head receives the backbone's last hidden states unchanged, (2) lm_head is the linear map of
    its weight and bias, (3) the returned logits are the scale / soft-cap of lm_head's output that
    `head` applies. Tolerance: 4 ulps of the logits' dtype relative to their size (a missing cap of c
    changes a logit z by z - c·tanh(z/c), a missing scale by a factor), plus for (2) the rounding bound of
    a K-term dot product, 2·γ_K·|x|·|W|ᵀ (lm_head's kernel may sum in another order than F.linear).
    Raises UserError otherwise."""
    seen: dict = {}
    backbone, lm_head = backbone_of(inner), inner.get_output_embeddings()

    def on_backbone(module, args, out):  # a forward hook must return None (anything else replaces the output)
        seen["h"] = _last_hidden(out)

    def on_head(module, args, out):
        seen.update(x=args[0], u=out)

    hooks = [backbone.register_forward_hook(on_backbone), lm_head.register_forward_hook(on_head)]
    vocab = head.weight.shape[0]
    ids = ((torch.arange(tokens) * 7919 + 11) % vocab)[None].to(head.weight.device)
    cuda = [ids.device] if ids.device.type == "cuda" else []
    try:  # the random state is restored: a dropout in the check must not shift a resumed run's draws
        with torch.autocast(ids.device.type, enabled=False), torch.random.fork_rng(devices=cuda):
            logits = inner(input_ids=ids, use_cache=False).logits
    finally:
        for hk in hooks:
            hk.remove()
    name = type(inner).__name__
    if "u" not in seen or "h" not in seen:
        raise UserError(f"{name}: its forward does not call its output embeddings and backbone as modules; "
                        "posttrain cannot check that its log-probs match the model's logits")
    u, x = seen["u"], seen["x"]
    # lm_head's own kernel may sum in another order than F.linear (oneDNN vs the BLAS): a dot product of K
    # terms rounds by at most γ_K·Σ|x_k·w_k|, γ_K = K·u/(1 − K·u) (u: unit roundoff), whatever the order
    u_round = torch.finfo(u.dtype).eps / 2
    K = x.shape[-1]
    gamma = K * u_round / (1 - K * u_round)
    magnitude = F.linear(x.abs().float(), head.weight.abs().float(), None if head.bias is None else head.bias.abs().float())
    checks = (("the hidden states lm_head receives", x, seen["h"], 0.0),
              ("lm_head's output", u, F.linear(x, head.weight, head.bias), 2 * gamma * float(magnitude.max())),
              (f"the logits (posttrain applies scale {head.scale}, soft-cap {head.softcap})", logits,
               HeadMap(head.scale, head.softcap).apply(u.float())[0], 0.0))
    for what, got, want, order_tol in checks:
        got, want = got.float().reshape(want.shape), want.float()
        tol = 4 * torch.finfo(logits.dtype).eps * max(1.0, float(want.abs().max())) + order_tol
        err = float((got - want).abs().max())
        if err > tol:
            raise UserError(f"{name} post-processes its logits in a way posttrain's log-prob head does not reproduce: "
                            f"{what} differ by {err:.3g} (tolerance {tol:.3g}); add its transform to "
                            "posttrain.models.forward.head_transform")


def _last_hidden(out):
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


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


def hidden_states(model, batch: Batch, mixed_precision: str = "none", layout=None, tie=None) -> torch.Tensor:
    """Last hidden states (B, T, H) of the decoder for a packed or padded batch.

    `layout` (ops.attention.Layout, per row its shared-prefix blocks) replaces the segments derived
    from the position ids: a group's prompt runs once and its completions attend to it.

    Under mixed precision the residual stream and the final norm stay fp32 (fp32 embeddings + bf16
    matmul outputs promote to fp32), so the returned states are fp32. `tie`: the head's TiedGrad (`logit_head`),
    which then does the embedding lookup."""
    backbone = backbone_of(model)
    extra = {}
    if getattr(unwrap(model).config, "_attn_implementation", None) == VARLEN:
        if layout is not None:
            extra["layout"] = layout
        else:
            extra["segments"] = segments_from_positions(batch.position_ids, batch.row_tokens)  # per-sample causal attention
    elif layout is not None:
        raise ValueError("a shared-prefix layout needs posttrain's varlen attention (load_model(varlen_attention=True))")
    with compute_precision(mixed_precision, batch.input_ids.device):
        ids = {"input_ids": batch.input_ids} if tie is None else {"inputs_embeds": tie.embed(batch.input_ids)}
        out = backbone(
            **ids,
            position_ids=batch.position_ids,
            attention_mask=batch.attention_mask,
            use_cache=False,
            **extra,
        )
    return _last_hidden(out)


def token_logprobs(model, batch: Batch, temperature: float = 1.0, with_entropy: bool = False, chunk: int = 1024,
                   mixed_precision: str = "none"):
    """log p(target) at every loss position, flattened in row-major order: (M,), entropy (M,) | None.

    lm_head + log-softmax always run in the head's own dtype (fp32 for fp32 weights), also under
    mixed precision: bf16 logits would err by ~0.1 nat at |z| ~ 20."""
    head = logit_head(model)
    h = hidden_states(model, batch, mixed_precision, tie=head.tie)
    sel = batch.targets != IGNORE  # (B, T)
    return head.logprobs(h[sel], batch.targets[sel], temperature, with_entropy=with_entropy, chunk=chunk)
