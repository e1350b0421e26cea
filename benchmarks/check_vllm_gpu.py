"""GPU check of the vLLM backend (and the built-in engine in bf16) against the trainer's recomputation.

    python benchmarks/check_vllm_gpu.py [--model smollm2-135m-instruct]

Needs a CUDA GPU and `pip install 'posttrain[vllm]'`. Checks, on a few chat prompts:
1. vLLM greedy == built-in engine greedy (bf16 on GPU), token for token on most prompts (bf16 kernels
   differ, so a late divergence is reported, not failed, unless the first 8 tokens differ);
2. vLLM's behaviour log-probs (temperature 0.7, top_p 0.9) vs the HF model's recomputation through
   posttrain.ops.sampling.process_logits in fp32: max |Δ logp| printed, must be < 0.1 (bf16 engine);
3. the built-in engine in bf16 on GPU vs the same recomputation: max |Δ logp| printed;
4. update_weights: after perturbing lm_head/embeddings, vLLM's greedy output changes.
Exits non-zero on failure.
"""

from __future__ import annotations

import argparse
import sys

import torch

from posttrain.models.loading import load_model, load_tokenizer, resolve
from posttrain.ops.sampling import process_logits
from posttrain.rollout.engine import Engine, EngineConfig
from posttrain.rollout.types import Request, SamplingParams
from posttrain.rollout.vllm_backend import VLLMBackend


def recompute(model, prompt, completion, params) -> torch.Tensor:
    ids = torch.tensor([prompt + completion], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    lp = process_logits(logits, params.temperature, params.top_k, params.top_p)
    return lp.gather(-1, torch.tensor(completion, device=lp.device)[:, None]).squeeze(-1).cpu()


def check(model: str = "smollm2-135m-instruct") -> dict:
    """Run the four checks on CUDA (printing as it goes); returns the measured numbers and `failures`."""
    tok = load_tokenizer(model)
    msgs = ["What is 2+2?", "Write a haiku about the sea.", "Explain gravity in two sentences.", "hi"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True, tokenize=True, return_dict=False) for m in msgs]
    failures, result = [], {"model": model}

    vb = VLLMBackend(resolve(model), dtype="bfloat16", max_model_len=1024)
    ref32 = load_model(model, dtype="float32", device="cuda").eval()
    bf16 = load_model(model, dtype="bfloat16", device="cuda").eval()
    engine = Engine(bf16, tok, EngineConfig(max_num_seqs=64, max_model_len=1024, kv_cache_mb=2048))

    greedy = SamplingParams(temperature=0, max_new_tokens=48)
    v_out = vb.generate([Request(p, greedy) for p in prompts])
    e_out = engine.generate([Request(p, greedy) for p in prompts])
    for i, (a, b) in enumerate(zip(v_out, e_out)):
        x, y = a.samples[0].token_ids, b.samples[0].token_ids
        same = next((k for k, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        print(f"greedy prompt {i}: vLLM {len(x)} tokens, engine {len(y)} tokens, agree on first {same}")
        result.setdefault("greedy_agree_tokens", []).append(same)
        if same < min(8, len(x), len(y)):
            failures.append(f"greedy prompt {i} differs within 8 tokens")

    sp = SamplingParams(n=4, temperature=0.7, top_p=0.9, max_new_tokens=48, seed=1)
    for name, outs in (("vllm", vb.generate([Request(p, sp) for p in prompts])), ("engine-bf16", engine.generate([Request(p, sp) for p in prompts]))):
        worst = 0.0
        for p, o in zip(prompts, outs):
            for s in o.samples:
                d = (torch.tensor(s.logprobs) - recompute(ref32, p, s.token_ids, sp)).abs()
                worst = max(worst, float(d[torch.isfinite(d)].max()) if d.numel() else 0.0)
        print(f"{name}: max |logp - fp32 recomputation| = {worst:.4f}")
        result[f"{name}_max_dlogp"] = worst
        if worst > 0.1:
            failures.append(f"{name} behaviour log-probs off by {worst:.3f}")

    w = torch.randn_like(bf16.lm_head.weight) * 0.02  # tied models: vLLM reads the embedding
    sd = {"model.embed_tokens.weight": w, "lm_head.weight": w}
    vb.update_weights(sd)
    changed = vb.generate([Request(prompts[0], greedy)])[0].samples[0].token_ids
    print("update_weights changed vLLM output:", changed != v_out[0].samples[0].token_ids)
    result["update_weights_changed_output"] = changed != v_out[0].samples[0].token_ids
    if changed == v_out[0].samples[0].token_ids:
        failures.append("update_weights had no effect")
    return {**result, "failures": failures}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU: this check needs one")
        return 2
    failures = check(args.model)["failures"]
    print("FAIL:\n  " + "\n  ".join(failures) if failures else "OK")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
