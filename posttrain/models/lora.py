"""LoRA through PEFT: W' = W + (alpha / r) · B A on the chosen linear layers (all of them by default).

LoRA does not train embeddings or lm_head; when tokens are added to the vocabulary, those modules
must be trained in full (`modules_to_save`), otherwise the new rows stay random.
"""

from __future__ import annotations

import contextlib

import torch
from pydantic import Field, field_validator

from posttrain.config import Config


class LoraSettings(Config):
    enabled: bool = Field(False, description="train a LoRA adapter instead of all weights")
    r: int = Field(16, ge=1, description="adapter rank")
    alpha: float = Field(32.0, gt=0, description="scale numerator: the update is (alpha / r) * B A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter input")
    target_modules: str = Field("all-linear", description="'all-linear' or comma-separated module names (q_proj,v_proj)")
    modules_to_save: list[str] = Field(default_factory=list, description="modules trained in full (embed_tokens, lm_head) e.g. after adding tokens")

    @field_validator("target_modules", mode="before")
    @classmethod
    def _names(cls, v):
        """PEFT's list form too: [q_proj, v_proj] (a YAML list, or that text kept from the command line)."""
        if isinstance(v, (list, tuple)):
            return ",".join(str(x) for x in v)
        if isinstance(v, str) and v.strip().startswith("[") and v.strip().endswith("]"):
            return ",".join(x.strip().strip("'\"") for x in v.strip()[1:-1].split(","))
        return v


def apply_lora(model, cfg: LoraSettings, task_type: str = "CAUSAL_LM"):
    """`task_type` SEQ_CLS (reward models): PEFT also trains the new `score` head in full."""
    from peft import LoraConfig, get_peft_model

    targets = cfg.target_modules if cfg.target_modules == "all-linear" else [t.strip() for t in cfg.target_modules.split(",") if t.strip()]
    check_modules(model, targets, cfg.modules_to_save)
    peft_cfg = LoraConfig(
        r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
        modules_to_save=cfg.modules_to_save or None, task_type=task_type, bias="none",
    )
    return get_peft_model(model, peft_cfg)


def check_modules(model, targets: str | list[str], modules_to_save: list[str]) -> None:
    """Every name in lora.target_modules and lora.modules_to_save names a module of `model`, as PEFT matches them
    (the full name, or its last components: `q_proj` is every `...self_attn.q_proj`). PEFT refuses an unknown
    target with its own traceback and silently skips an unknown module to save."""
    from posttrain.errors import UserError

    names = [n for n, _ in model.named_modules() if n]

    def found(key: str) -> bool:
        return any(n == key or n.endswith("." + key) for n in names)

    def leaves(kind=None) -> str:
        tails = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                        if n and not n.rsplit(".", 1)[-1].isdigit() and (kind is None or isinstance(m, kind))})
        return ", ".join(tails[:12]) + (", ..." if len(tails) > 12 else "")

    model_type = getattr(getattr(model, "config", None), "model_type", "the model")
    for key in [] if targets == "all-linear" else targets:
        if not found(key):
            raise UserError(f"lora.target_modules: {model_type} has no module '{key}' (its linear layers: "
                            f"{leaves(torch.nn.Linear)}; or all-linear)")
    for key in modules_to_save:
        if not found(key):
            raise UserError(f"lora.modules_to_save: {model_type} has no module '{key}' (e.g. embed_tokens, lm_head; "
                            f"its modules: {leaves()})")


def trainable_fraction(model) -> tuple[int, int]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total


def memory_savers(model, lora: LoraSettings | None, gradient_checkpointing: bool, task_type: str = "CAUSAL_LM"):
    """The trainable form of a loaded causal LM: gradient checkpointing (each decoder layer's activations
    recomputed in backward; non-reentrant, so packed/varlen keyword arguments pass through), then the LoRA
    adapter. Returns the model to train (the PEFT wrapper when LoRA is on)."""
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if lora is not None and lora.enabled:
        model = apply_lora(model, lora, task_type)
        if gradient_checkpointing:
            model.enable_input_require_grads()  # frozen embeddings: the checkpointed layers still need a grad path
    return model


class AdapterOff:
    """The reference policy of a LoRA run: the policy's own base weights, its adapter switched off while the
    reference runs (π_ref = the base, exactly; no second copy of the weights). Use through `reference_view`."""

    def __init__(self, peft_model):
        self.model = peft_model

    def __enter__(self):
        self._ctx = self.model.disable_adapter()
        self._ctx.__enter__()
        return self.model

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def reference_view(ref):
    """`with reference_view(ref) as model:` the module to run as π_ref: a frozen copy as it is, or the LoRA
    policy with its adapter disabled (AdapterOff)."""
    return ref if isinstance(ref, AdapterOff) else contextlib.nullcontext(ref)
