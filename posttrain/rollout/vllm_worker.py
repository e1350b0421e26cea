"""Methods posttrain adds to every vLLM worker (`LLM(worker_extension_cls="posttrain.rollout.vllm_worker.WeightSync")`).

vLLM mixes this class into its worker class, so each method runs inside the worker process with `self` = the worker;
the trainer calls them by name: `llm.collective_rpc("posttrain_load_weights", args=(path,))`. Only a string crosses
the process boundary (vLLM V1 refuses a pickled function unless VLLM_ALLOW_INSECURE_SERIALIZATION=1, and tensors
inside utility-call arguments arrive as raw buffer indices): the weights travel as a safetensors file the trainer
wrote (in /dev/shm where it exists: memory, not disk). Imported by vLLM in its own process; needs only torch and
safetensors.
"""

from __future__ import annotations


class WeightSync:
    def posttrain_load_weights(self, path: str) -> int:
        """Load every tensor of the safetensors file at `path` (HF parameter names) into the running model through the
        worker's `reload_weights` (vLLM's in-place reload: the model's own name mapping, fused q/k/v and gate/up shards,
        tied embeddings, and the kernel repacking done after loading, e.g. the CPU backend's packed linear weights, which
        a plain `model.load_weights` would find emptied). -> tensors read."""
        from safetensors import safe_open

        with safe_open(path, framework="pt", device="cpu") as f:
            weights = [(name, f.get_tensor(name)) for name in f.keys()]
        self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        return len(weights)

    def posttrain_weight_sums(self) -> dict[str, float]:
        """{parameter name: float64 sum} of the running model's weights (vLLM's names): for tests and checks."""
        return {name: float(p.detach().double().sum()) for name, p in self.model_runner.model.named_parameters()}
