"""Scale-out settings of a run (the `systems.*` config section; the CLI accepts the last component
alone, e.g. `posttrain rl async_rl=true max_staleness=2 cluster=ray`). docs/scale.md explains them."""

from __future__ import annotations

from pydantic import Field, model_validator

from posttrain.config import Config


class SystemsSettings(Config):
    async_rl: bool = Field(False, description="overlap rollout and training: a rollout thread (or Ray actor) feeds a bounded queue while the trainer updates")
    max_staleness: int = Field(1, ge=0, description="k: a sample drawn by policy version v is used at trainer step s only if s - v <= k (0 = on-policy, same samples as synchronous)")
    partial_rollouts: str = Field("finish", pattern="^(finish|drop)$",
                                  description="samples in flight when a newer policy is published: finish (under the version that started them; the new weights load when they are done) | drop (new weights load at once; those samples are discarded)")
    rollout_backend: str = Field("builtin", pattern="^(builtin|vllm)$", description="async RL rollouts: the built-in engine | vllm (GPU, pip install 'posttrain[vllm]'; weights pushed to it by version)")
    vllm_gpu_memory_utilization: float = Field(0.4, gt=0, le=1, description="rollout_backend=vllm: share of the GPU vLLM may take (the trainer shares the GPU)")
    queue_groups: int = Field(0, ge=0, description="bound of the rollout queue in groups (0 = (max_staleness + 2) x prompts_per_step)")
    cluster: str = Field("local", pattern="^(local|ray)$", description="local (one process) | ray (rollout, reward and trainer as Ray actors; pip install 'posttrain[ray]')")
    ray_address: str = Field("", description="cluster=ray: address of an existing Ray cluster ('' = start a local one with ray.init())")
    ray_num_cpus: int | None = Field(None, ge=1, description="cluster=ray, local cluster only: CPUs Ray may use (None = all)")
    trainer_cpus: float = Field(1.0, gt=0, description="cluster=ray: CPUs requested by the trainer actor")
    rollout_cpus: float = Field(0.5, gt=0, description="cluster=ray: CPUs requested by the rollout worker actor")
    reward_cpus: float = Field(0.5, gt=0, description="cluster=ray: CPUs requested by the reward worker actor")
    rollout_gpus: float = Field(0.0, ge=0, description="cluster=ray: GPUs requested by the rollout worker actor")

    @model_validator(mode="after")
    def _check(self):
        if self.cluster == "local" and self.ray_address:
            raise ValueError("systems.ray_address is set but cluster=local: add cluster=ray")
        return self

    @property
    def pipelined(self) -> bool:
        """Rollout through the producer pipeline (systems/async_rl.py): async RL, or any Ray run."""
        return self.async_rl or self.cluster == "ray"

    def queue_bound(self, prompts_per_step: int) -> int:
        return self.queue_groups or (self.max_staleness + 2) * prompts_per_step
