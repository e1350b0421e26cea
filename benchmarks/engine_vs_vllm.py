"""Built-in engine vs vLLM (`backend=vllm`), same machine, same run: tokens/s of each and their ratio.

    make .venv-vllm/.installed && .venv-vllm/bin/posttrain models fetch smollm2-135m-instruct
    .venv-vllm/bin/python benchmarks/engine_vs_vllm.py [--dtype float32|bfloat16] [--prompts 8] [--samples 8] [--new-tokens 64] [--repeats 2] [--eager]

SmolLM2-135M-Instruct, the chat prompts of engine_vs_hf.py, temperature 1 with no top-k/top-p and no early stop
(ignore_eos on both), so both produce exactly prompts x samples x new_tokens tokens; one request per prompt with
n = samples on both sides. vLLM: its default settings (torch.compile warm-up unless --eager; on the CPU its KV cache
is VLLM_CPU_KVCACHE_SPACE GiB, 4 here), its engine in its own process as by default; kept-set sizes are not computed
(no truncation). Each side is timed `repeats` times after a warm-up, alternating, and the best time is kept (the
machine is shared); the prefix cache is reset before every repeat on both. Prints `ratio: N.NNx` = engine tokens/s
over vLLM tokens/s. Writes benchmarks/results/engine_vs_vllm.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--eager", action="store_true", help="vLLM without torch.compile (enforce_eager)")
    args = ap.parse_args()

    import torch
    from engine_vs_hf import chat_prompts

    from posttrain.models.loading import load_model, load_tokenizer, resolve
    from posttrain.rollout.engine import Engine, EngineConfig
    from posttrain.rollout.types import Request, SamplingParams
    from posttrain.rollout.vllm_backend import VLLMBackend

    tok = load_tokenizer(args.model)
    ids = chat_prompts(tok, args.prompts)
    n_tokens = args.prompts * args.samples * args.new_tokens
    max_len = max(len(p) for p in ids) + args.new_tokens + 1
    params = SamplingParams(n=args.samples, temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0)
    model = load_model(args.model, dtype=args.dtype).eval()
    engine = Engine(model, tok, EngineConfig(max_num_seqs=args.prompts * args.samples, max_model_len=max_len,
                                             kv_cache_mb=2048, max_prefill_tokens=8192))
    t0 = time.perf_counter()
    vllm = VLLMBackend(str(resolve(args.model)), dtype=args.dtype, max_model_len=max_len,
                       **({"enforce_eager": True} if args.eager else {}))
    vllm_start_s = time.perf_counter() - t0

    def run(backend, reset):
        reset()
        t = time.perf_counter()
        outs = backend.generate([Request(p, params) for p in ids])
        seconds = time.perf_counter() - t
        got = sum(len(s.token_ids) for o in outs for s in o.samples)
        assert got == n_tokens, got
        return seconds

    warm = [Request(ids[0], SamplingParams(n=2, max_new_tokens=4, ignore_eos=True))]
    engine.generate(warm)
    vllm.generate(warm)
    en_t, v_t = [], []
    for _ in range(args.repeats):
        en_t.append(run(engine, engine.reset_prefix_cache))
        v_t.append(run(vllm, vllm.llm.reset_prefix_cache))
    en_tps, v_tps = n_tokens / min(en_t), n_tokens / min(v_t)
    result = {"model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(), "prompts": args.prompts,
              "samples": args.samples, "new_tokens": args.new_tokens, "tokens": n_tokens, "vllm_eager": args.eager,
              "vllm_start_s": vllm_start_s, "engine_seconds": en_t, "vllm_seconds": v_t,
              "engine_tokens_per_s": en_tps, "vllm_tokens_per_s": v_tps, "ratio": en_tps / v_tps}
    print(f"model {args.model} {args.dtype}  {args.prompts} prompts x {args.samples} samples x {args.new_tokens} tokens = {n_tokens} tokens")
    print(f"posttrain engine: {en_tps:8.1f} tok/s   (best of {len(en_t)}: {min(en_t):.2f} s)")
    print(f"vLLM            : {v_tps:8.1f} tok/s   (best of {len(v_t)}: {min(v_t):.2f} s; start-up {vllm_start_s:.0f} s)")
    print(f"ratio: {en_tps / v_tps:.2f}x")
    out = Path(__file__).parent / "results" / "engine_vs_vllm.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    vllm.close()


if __name__ == "__main__":  # vLLM starts its engine process with spawn
    main()
