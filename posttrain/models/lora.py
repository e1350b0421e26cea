"""LoRA through PEFT: W' = W + (alpha / r) · B A on the chosen linear layers (all of them by default).

LoRA does not train embeddings or lm_head; when tokens are added to the vocabulary, those modules
must be trained in full (`modules_to_save`), otherwise the new rows stay random.
"""

from __future__ import annotations

from pydantic import Field

from posttrain.config import Config


class LoraSettings(Config):
    enabled: bool = Field(False, description="train a LoRA adapter instead of all weights")
    r: int = Field(16, ge=1, description="adapter rank")
    alpha: float = Field(32.0, gt=0, description="scale numerator: the update is (alpha / r) * B A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter input")
    target_modules: str = Field("all-linear", description="'all-linear' or comma-separated module names (q_proj,v_proj)")
    modules_to_save: list[str] = Field(default_factory=list, description="modules trained in full (embed_tokens, lm_head) e.g. after adding tokens")


def apply_lora(model, cfg: LoraSettings):
    from peft import LoraConfig, get_peft_model

    targets = cfg.target_modules if cfg.target_modules == "all-linear" else [t.strip() for t in cfg.target_modules.split(",")]
    peft_cfg = LoraConfig(
        r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
        modules_to_save=cfg.modules_to_save or None, task_type="CAUSAL_LM", bias="none",
    )
    return get_peft_model(model, peft_cfg)


def trainable_fraction(model) -> tuple[int, int]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total
