"""`PlanConfig`: every key `posttrain plan` and `posttrain.plan.predict` accept."""

from __future__ import annotations

from typing import Optional

from pydantic import Field, field_validator, model_validator

from posttrain.config import Config

CPU_MFU = 0.5


class PlanConfig(Config):
    """Predict memory, tokens, FLOPs and time of a post-training method before running it (docs/planner.md).
    Add --json to print the prediction as JSON."""

    model: str = Field("tiny-random", description="HF folder, known architecture (llama-3-8b, llama-3-70b, qwen2.5-0.5b, "
                       "qwen2.5-7b, qwen3-0.6b, gemma-3-1b, smollm2-135m), built-in (tiny-random*, smollm2-135m-instruct), "
                       "a Hub id in the HF cache (org/name), or a parameter count (8e9, 8B)")
    method: str = Field("sft", description="sft | rm | dpo | ppo | grpo | rlvr | agent | distill | rs")

    # shape of a step
    batch: int = Field(8, ge=1, description="sequences per step (sft, distill logit/sequence), pairs (rm, dpo), or prompts (rs, ppo, grpo, rlvr, agent, distill on_policy)")
    group: Optional[int] = Field(None, ge=1, description="samples per prompt G (default 8 for grpo/rlvr/agent/rs, 1 otherwise); the N of best-of-N for rs")
    seq_len: int = Field(512, ge=1, description="tokens per sequence (sft, rm, dpo, distill logit); generated tokens per sample (rs, ppo, grpo, rlvr, distill); generated tokens per turn (agent)")
    prompt_len: int = Field(0, ge=0, description="prompt tokens per sample, processed but not generated (sampling methods)")
    turns: int = Field(1, ge=1, description="agent: model turns per trajectory")
    return_len: int = Field(0, ge=0, description="agent: environment/tool tokens returned after each turn but the last")
    micro_batch: Optional[int] = Field(None, ge=1, description="sequences per forward/backward for the activation estimate (default: the whole step)")
    logit_copies: float = Field(3, ge=0, description="(tokens × vocab) tensors alive at the loss: 3 for the HF loss, 1 with chunked selective log-softmax")

    # method options (the method table: `posttrain methods`)
    beta: Optional[float] = Field(None, ge=0, description="KL coefficient; 0 loads no reference (default: the method's, see `posttrain methods`)")
    reward: Optional[str] = Field(None, description="rs/ppo/grpo/rlvr/agent: 'model' (a reward model in memory) or 'verifier' (no model)")
    reward_model: Optional[str] = Field(None, description="size or architecture of the reward model (default: same as model)")
    value_model: Optional[bool] = Field(None, description="grpo/rlvr/agent: add a value model (PPO always has one)")
    precompute_ref: bool = Field(True, description="dpo: reference log-probs computed once beforehand, reference not held in memory")
    distill: str = Field("on_policy", description="distill: on_policy (student samples, teacher scores) | logit | sequence")
    teacher: Optional[str] = Field(None, description="distill: teacher size or architecture (default: same as model)")
    mode: Optional[str] = Field(None, description="distill: the same as `distill` (the key `posttrain distill` uses): on_policy | logit | sequence")
    top_k: int = Field(64, ge=1, description="distill: teacher log-probs stored per position (top-k)")
    data_tokens: Optional[float] = Field(None, gt=0, description="distill logit: loss tokens the teacher cache covers (one pass over the data): its size on disk and the teacher's one-time forward")

    # precision, memory savers (LoRA, gradient checkpointing)
    lora_r: int = Field(0, ge=0, description="LoRA rank (0 = full fine-tuning); needs an architecture, not a bare count")
    lora_targets: str = Field("all-linear", description="LoRA target modules: all-linear (every linear layer but lm_head) or a "
                              "comma list matched as PEFT does (q_proj,v_proj; phi3: qkv_proj,gate_up_proj,...)")
    gradient_checkpointing: bool = Field(False, description="trained models keep only each layer's input and recompute one layer "
                                         "at a time in backward: activations L·h + one layer per token; training 8 FLOPs/param/token")
    engine_bytes: float = Field(0, ge=0, description="memory the generation engine holds beside the models for the whole run "
                                "(its KV cache allocated up front, packed weight copies): a recipe passes its engine's own count")
    activation_fixed_bytes: Optional[float] = Field(None, ge=0, description="measured activations of a forward/backward that do "
                                                    "not grow with its tokens (weight casts, head tiles): training.memprobe")
    activation_bytes_per_token: Optional[float] = Field(None, gt=0, description="measured activation bytes per token of a forward/"
                                                        "backward (replaces the closed form; a recipe measures its model: training.memprobe)")
    shared_prefix: bool = Field(False, description="the training forward computes each group's prompt once and its samples "
                                "attend to it (posttrain's RL trainer): (G - 1)·prompt_len fewer activation tokens per group")
    embedding_grad_buffer: bool = Field(True, description="full fine-tuning: the input embedding's backward builds its own dense "
                                        "V×h gradient (stock PyTorch); false where a tied embedding's rows are added into the "
                                        "head's gradient instead (posttrain's forward on one CPU process, fp32 weights: ops/tied.py)")
    dtype: str = Field("bf16", description="dtype of frozen weights, KV cache and activations (bf16, fp16, fp32, fp8, int8, int4)")
    train_bytes_per_param: float = Field(16, gt=0, description="training state per trainable param (weights + grads + Adam m, v)")
    infer_bytes_per_param: Optional[float] = Field(None, gt=0, description="bytes per frozen param (default: from dtype)")
    kv_dtype: Optional[str] = Field(None, description="KV cache dtype (default: dtype)")

    # run length and hardware
    tokens: Optional[float] = Field(None, gt=0, description="tokens of the whole run (D), e.g. 2e9; or give steps")
    steps: Optional[int] = Field(None, ge=1, description="optimizer steps of the whole run")
    hardware: Optional[str] = Field(None, description="named accelerator: h100, h200, a100, b200 (sets peak_flops and device_memory); cpu: this machine's CPU, its matmul FLOP/s measured")
    compute_dtype: Optional[str] = Field(None, description="hardware=cpu: the dtype the matmuls run in, bf16 | fp32 (default: dtype; bf16 for mixed precision)")
    peak_flops: Optional[float] = Field(None, gt=0, description="peak FLOP/s of one device (H100 dense BF16: 989e12)")
    mfu: Optional[float] = Field(None, gt=0, le=1, description="model FLOPs utilisation, in (0, 1]: the share of the peak a compute-bound "
                                 "pass reaches (default 0.4; hardware=cpu 0.5 of its measured matmul peak)")
    memory_bandwidth: Optional[float] = Field(None, gt=0, description="memory bytes/s of one device (default: named hardware's HBM, "
                                              "hardware=cpu measured): decode steps are timed at the roofline with it")
    mbu: float = Field(0.5, gt=0, le=1, description="memory bandwidth utilisation, in (0, 1]: the share of the bandwidth a decode step's reads reach")
    decode_batch: Optional[int] = Field(None, ge=1, description="sequences decoded at once (the engine's max_num_seqs; default: every sequence of the step)")
    devices: int = Field(1, ge=1, description="devices sharing a step (divides seconds_per_step)")
    device_memory: Optional[float] = Field(None, gt=0, description="bytes of memory per device, e.g. 80e9 (gives devices_for_memory)")

    # evaluation uncertainty
    eval_n: int = Field(0, ge=0, description="items of an evaluation: prints the 95% interval half-width (0 = skip)")
    eval_p: float = Field(0.5, ge=0, le=1, description="accuracy used for the interval (0.5 = widest)")

    @model_validator(mode="after")
    def _default_mfu(self):
        # On the CPU the matmul peak is measured on a model-sized matmul: SmolLM2-135M's SFT step reached 0.61 of it,
        # the GRPO update 0.37 and its fp32 decode 0.43 (docs/planner.md); accelerators keep the usual 0.4.
        if self.mfu is None:
            self.__dict__["mfu"] = CPU_MFU if (self.hardware or "").lower() == "cpu" else 0.4
        return self

    @model_validator(mode="after")
    def _mode_is_distill(self):
        if self.mode is not None:
            if "distill" in self.model_fields_set and self.distill != self.mode:
                raise ValueError(f"mode={self.mode} and distill={self.distill} disagree: give one of them")
            self.__dict__["distill"] = self.mode
        return self

    @field_validator("model", "reward_model", "teacher", mode="before")
    @classmethod
    def _number_as_text(cls, v):
        # `model=8000000000` arrives as an int and `model=7.0e9` as a float from the YAML parser.
        return str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
