"""Built-in engine vs HF `generate`, same machine, same run: tokens/s, ratio, decode FLOP/s over peak.

    .venv/bin/python benchmarks/engine_vs_hf.py [--dtype bfloat16|float32] [--prompts 8] [--samples 8] [--new-tokens 64] [--repeats 3] [--threads 0] [--device cpu]

SmolLM2-135M-Instruct on CPU (or --device cuda; benchmarks/check_gpu.py calls `compare` on CUDA), in bf16 (default: weights, activations and KV cache in bf16 on both
sides; AMX matmuls on CPUs that have them) or fp32 (--dtype float32). Both sides sample at temperature 1 with no top-k/top-p and no
early stop (HF: min_new_tokens = max_new_tokens; engine: ignore_eos), so both produce exactly
prompts × samples × new_tokens tokens. HF runs one padded batch with num_return_sequences=samples
(its fastest usage); the engine gets one request per prompt with n=samples. Each side is timed
`repeats` times after a warm-up on the same job, alternating, and the best time is kept (the machine is shared) for
tokens/s.
Decode FLOPs = 2·(linear params incl. lm_head)·tokens + 4·layers·heads·head_dim·context per token;
the peak is the best 2048³ matmul in the same dtype, in this process, with the same thread count, measured before and after
each engine repeat (the higher of the two is that repeat's peak: a shared host's speed drifts within minutes), and the
median repeat's decode/peak is reported (prefill: that repeat's too). The ceiling
at the decode shape: the engine's own packed linears alone (every layer's q|k|v, o, gate|up, down, then the
lm_head, on random rows of the decode batch, weights streamed from memory as in a step), timed in the same run:
what a decode step would take with nothing but its matmuls (against the higher of the median repeat's peak and one
measured right after the linears). Prefill is
reported the same way (each prompt once), and decode's memory side: the bytes a step must read at least
(every weight once, each sample's KV over its context) per second, against a large copy's bandwidth. On CPU the
decode attention alone too (`engine_attention.py`, every layer, halfway through the new tokens, KV hot).
Writes benchmarks/results/engine_vs_hf.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from posttrain.models.device import synchronize
from posttrain.models.loading import load_model, load_tokenizer
from posttrain.ops import cpu_kernels
from posttrain.ops import linear as ops_linear
from posttrain.rollout.engine import Engine, EngineConfig
from posttrain.rollout.runner import _weight
from posttrain.rollout.types import Request, SamplingParams

TOPICS = ["What is 2+2?", "Write a haiku about the sea.", "Explain gravity to a child in two sentences.", "hi",
          "List three uses of a paperclip and say which one is the most surprising.", "Translate 'good morning' to French.",
          "Why is the sky blue? Answer briefly, then give one fun fact about light.", "Name a prime number."]


def matmul_peak(dtype: torch.dtype, n: int = 2048, reps: int = 5, device: str | torch.device = "cpu") -> float:
    """FLOP/s of the fastest n³ matmul of torch's and posttrain's (`ops.linear.matmul`: in bf16 on a CPU without
    bf16 instructions, or an Intel one without AMX, an fp32 GEMM over the bf16 values; the engine's packed GEMM,
    `packed_matmul`): the best this machine multiplies numbers of `dtype` with."""
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    best = float("inf")
    for mm in (torch.matmul, ops_linear.matmul, packed_matmul(b)):
        if mm is None:
            continue
        mm(a, b)
        best = min(best, *(_timed(lambda mm=mm: mm(a, b), device) for _ in range(reps)))
    return 2 * n**3 / best


def packed_matmul(b: torch.Tensor):
    """(a, b) -> a·b for this b through the engine's packed GEMM (`cpu_kernels.gemm_packed`, b packed once as a weight is): bf16
    panels on CPUs with AVX-512 BF16, else float32 panels (bf16 values widened, as the engine keeps them where bf16
    is software); None where the kernel does not run (not an x86 CPU with AVX2, or not float32/bf16)."""
    w = b.t().contiguous()  # (N, K): the packed GEMM computes a·wᵀ
    if cpu_kernels.gemm_bf16_runs(w):
        packed = cpu_kernels.gemm_pack_bf16(w)
        return lambda a, _b: cpu_kernels.gemm_packed(a, packed, w.shape[0])
    if cpu_kernels.gemm_runs(w):
        packed = cpu_kernels.gemm_pack(w)
        return lambda a, _b: cpu_kernels.gemm_packed(a.float(), packed, w.shape[0])
    return None


def _timed(fn, device: str | torch.device = "cpu") -> float:
    """Wall seconds of fn(), waiting for queued GPU work before and after."""
    device = torch.device(device)
    synchronize(device)
    t = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t


def decode_flops(model, prompt_lens: list[int], samples: int, new_tokens: int) -> float:
    """FLOPs of the decode steps (tokens 2..new_tokens of every sample; token 1 comes from the prefill)."""
    linear, attn_per_ctx = _linear_and_attention(model)
    total = 0.0
    for L in prompt_lens:
        for t in range(1, new_tokens):  # feeding the t-th generated token; context L + t
            total += samples * (2 * linear + attn_per_ctx * (L + t))
    return total


def prefill_flops(model, prompt_lens: list[int]) -> float:
    """FLOPs of the prefill: every prompt once (the engine shares it among the samples), logits at its last token."""
    linear, attn_per_ctx = _linear_and_attention(model)
    head = model.get_output_embeddings().weight.numel()
    return sum(2 * (linear - head) * L + 2 * head + attn_per_ctx * L * (L + 1) / 2 for L in prompt_lens)


def decode_bytes(model, prompt_lens: list[int], samples: int, new_tokens: int) -> float:
    """Bytes a decode step must read at least, summed over the steps: every weight once per step (shared by the
    batch) and each sample's KV cache over its context. Decode at small batch is bound by this, not by FLOPs."""
    cfg = model.config
    size = next(model.parameters()).element_size()
    linear, _ = _linear_and_attention(model)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * hd * size
    total = 0.0
    for t in range(1, new_tokens):
        total += linear * size + sum(samples * kv_per_token * (L + t) for L in prompt_lens)
    return total


def _linear_and_attention(model) -> tuple[int, int]:
    cfg = model.config
    linear = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n)
    if cfg.tie_word_embeddings:
        linear += model.lm_head.weight.numel()
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return linear, 4 * cfg.num_hidden_layers * cfg.num_attention_heads * hd


def chat_prompts(tok, count: int) -> list[list[int]]:
    msgs = [TOPICS[i % len(TOPICS)] for i in range(count)]
    return [tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True, tokenize=True, return_dict=False) for m in msgs]


def compare(model, tok, prompts: int = 8, samples: int = 8, new_tokens: int = 64, repeats: int = 2) -> dict:
    """Time HF generate and the engine on the same jobs, on the model's device; returns the result dict."""
    device = next(model.parameters()).device
    ids = chat_prompts(tok, prompts)
    lens = [len(p) for p in ids]
    n_tokens = prompts * samples * new_tokens

    # HF: one left-padded batch, num_return_sequences = samples
    tok.padding_side = "left"
    enc = tok.pad({"input_ids": ids}, return_tensors="pt").to(device)
    hf_kwargs = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "num_return_sequences": samples,
                 "max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "pad_token_id": tok.pad_token_id}

    def run_hf():
        with torch.inference_mode():
            out = model.generate(**enc, **hf_kwargs)
        assert out.shape == (prompts * samples, enc["input_ids"].shape[1] + new_tokens), out.shape

    cfg = EngineConfig(max_num_seqs=prompts * samples, max_model_len=max(lens) + new_tokens + 1,
                       kv_cache_mb=2048, max_prefill_tokens=8192)
    engine = Engine(model, tok, cfg)
    params = SamplingParams(n=samples, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens, ignore_eos=True)

    def run_engine():
        engine.reset_prefix_cache()  # every repeat prefills its prompts again (weights unchanged: no repacking)
        outs = engine.generate([Request(p, params) for p in ids])
        got = sum(len(s.token_ids) for o in outs for s in o.samples)
        assert got == n_tokens, got

    # warm-up: the timed job itself, once on each side (allocator, oneDNN kernels / CUDA context, and the engine's
    # one-time growth of its group KV to this job's reach: ~0.2 s that a smaller warm-up left in the first repeat).
    # Both then run at their steady state, as in RL, where every step generates the same shape.
    run_hf()
    run_engine()

    # The host's speed drifts by tens of percent within minutes (shared machines): each engine repeat is compared
    # with the peak measured right before and right after it (the higher of the two), and the median repeat is
    # reported, not the best time over one peak measured elsewhere in the run.
    dtype = next(model.parameters()).dtype
    hf_t, en_t, runs, peaks = [], [], [], [matmul_peak(dtype, device=device)]
    for _ in range(repeats):
        hf_t.append(_timed(run_hf, device))
        engine.stats.__init__()
        en_t.append(_timed(run_engine, device))
        runs.append(engine.metrics())
        peaks.append(matmul_peak(dtype, device=device))
    flops, pre = decode_flops(model, lens, samples, new_tokens), prefill_flops(model, lens)
    near = [max(a, b) for a, b in zip(peaks, peaks[1:])]  # each repeat's peak
    decode_ratio = [flops / m["decode_s"] / p for m, p in zip(runs, near)]
    mid = sorted(range(repeats), key=decode_ratio.__getitem__)[(repeats - 1) // 2]  # the median repeat (lower middle)
    en_metrics, peak = runs[mid], near[mid]
    linears_s, linear_flops = linears_alone(engine.runner, prompts * samples)
    linears_peak = max(peak, matmul_peak(dtype, device=device))
    bandwidth = copy_bandwidth(device)
    traffic = decode_bytes(model, lens, samples, new_tokens)
    hf_tps, en_tps = n_tokens / min(hf_t), n_tokens / min(en_t)
    return {
        "device": str(device), "threads": torch.get_num_threads(), "prompts": prompts, "samples": samples,
        "new_tokens": new_tokens, "prompt_lens": lens, "tokens": n_tokens,
        "hf_seconds": hf_t, "engine_seconds": en_t, "hf_tokens_per_s": hf_tps, "engine_tokens_per_s": en_tps,
        "speedup": en_tps / hf_tps, "engine_metrics": en_metrics, "peaks_gflops": [p / 1e9 for p in peaks],
        "decode_over_peak_by_repeat": decode_ratio,
        "matmul_peak_gflops": peak / 1e9, "decode_gflops": flops / en_metrics["decode_s"] / 1e9,
        "decode_flops_over_peak": decode_ratio[mid],
        "prefill_gflops": pre / en_metrics["prefill_s"] / 1e9, "prefill_flops_over_peak": pre / en_metrics["prefill_s"] / peak,
        "decode_step_ms": en_metrics["decode_s"] / en_metrics["decode_steps"] * 1e3,
        "linears_alone_ms": linears_s * 1e3, "linears_alone_gflops": linear_flops / linears_s / 1e9,
        "linears_alone_over_peak": linear_flops / linears_s / linears_peak,
        "copy_bandwidth_gbs": bandwidth / 1e9, "decode_min_gbs": traffic / en_metrics["decode_s"] / 1e9,
        "decode_bytes_over_bandwidth": traffic / en_metrics["decode_s"] / bandwidth,
        **attention_alone(engine.runner, lens, samples, new_tokens),
    }


@torch.inference_mode()
def linears_alone(runner, rows: int, reps: int = 5) -> tuple[float, float]:
    """(seconds, FLOPs) of one decode step's linears alone: the runner's packed q|k|v, o (+ residual), gate|up,
    down (+ residual) of every layer in order, then the lm_head, on `rows` random rows; best of `reps`."""
    H = runner.embed.weight.shape[1]
    x = torch.randn(rows, H, dtype=runner.dtype, device=runner.device)
    inner = _weight(runner.down[0].mods[0]).shape[1]  # the MLP's width (gate|up may return silu(gate) * up already)
    a_o = torch.randn(rows, runner.n_heads * runner.head_dim, dtype=runner.dtype, device=runner.device)
    a_d = torch.randn(rows, inner, dtype=runner.dtype, device=runner.device)

    def step():
        for i in range(len(runner.layers)):
            runner.qkv[i](x)
            runner.o[i](a_o, residual=x)
            runner.gate_up[i](x)
            runner.down[i](a_d, residual=x)
        runner.lm_head(x)

    step()
    best = min(_timed(step, runner.device) for _ in range(reps))
    linears = (*runner.qkv, *runner.o, *runner.gate_up, *runner.down, runner.lm_head)
    return best, 2 * rows * sum(_weight(m).numel() for lin in linears for m in lin.mods)


def attention_alone(runner, prompt_lens: list[int], samples: int, new_tokens: int) -> dict:
    """The decode attention of one step alone, every layer, at this run's shape halfway through the new tokens (KV
    hot): `engine_attention.compare`, the group kernel against torch SDPA over the same KV. Empty where the step
    does not run that kernel: one sample per prompt (no group KV), or the runner's own choice against it
    (`group_kernel`: not a CPU, attention logits soft-capped, or the kernel not built; masked SDPA runs there)."""
    if samples < 2 or not runner.group_kernel:
        return {}
    from engine_attention import compare as attention_compare  # (it imports this file)

    r = attention_compare(prompt_lens, samples, new_tokens // 2, runner.n_heads, runner.n_kv, runner.head_dim, runner.dtype,
                          reps=100)
    layers = len(runner.layers)
    return {"attention_alone_ms": r["ours_us"] * layers / 1e3, "attention_sdpa_ms": r["sdpa_us"] * layers / 1e3,
            "attention_over_peak": r["ours_over_peak"]}


def copy_bandwidth(device, mib: int = 256, reps: int = 5) -> float:
    """Bytes/s of a large tensor copy (read + write) on `device`, best of `reps`."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src), device) for _ in range(reps))
    return 2 * src.numel() / best


def report(result: dict, dtype: str) -> None:
    r, m = result, result["engine_metrics"]
    print(f"model {r['model']} on {r['device']}  threads {r['threads']}  {r['prompts']} prompts x {r['samples']} samples x {r['new_tokens']} tokens = {r['tokens']} tokens")
    print(f"HF generate     : {r['hf_tokens_per_s']:8.1f} tok/s   (best of {len(r['hf_seconds'])}: {min(r['hf_seconds']):.2f} s)")
    print(f"posttrain engine: {r['engine_tokens_per_s']:8.1f} tok/s   (best of {len(r['engine_seconds'])}: {min(r['engine_seconds']):.2f} s; "
          f"the median repeat: prefill {m['prefill_s']:.2f} s, decode {m['decode_s']:.2f} s)")
    print(f"speedup         : {r['speedup']:.2f}x")
    print(f"prefill         : {r['prefill_gflops']:.1f} GFLOP/s achieved / {r['matmul_peak_gflops']:.1f} GFLOP/s {dtype} matmul peak = {r['prefill_flops_over_peak']:.1%}")
    each = " ".join(f"{x:.1%}" for x in r["decode_over_peak_by_repeat"])
    print(f"decode          : {r['decode_gflops']:.1f} GFLOP/s achieved / {r['matmul_peak_gflops']:.1f} GFLOP/s {dtype} matmul peak = "
          f"{r['decode_flops_over_peak']:.1%} (median of the repeats: {each}; peaks {' '.join(f'{p:.0f}' for p in r['peaks_gflops'])})")
    print(f"decode ceiling  : the linears alone {r['linears_alone_ms']:.1f} ms/step = {r['linears_alone_gflops']:.1f} GFLOP/s = "
          f"{r['linears_alone_over_peak']:.1%} of peak; the whole decode step {r['decode_step_ms']:.1f} ms")
    if "attention_alone_ms" in r:
        print(f"decode attention: {r['attention_alone_ms']:.1f} ms/step alone halfway through the new tokens (KV hot) = "
              f"{r['attention_over_peak']:.1%} of peak; torch SDPA over the same KV {r['attention_sdpa_ms']:.1f} ms "
              f"(benchmarks/engine_attention.py)")
    print(f"decode memory   : >= {r['decode_min_gbs']:.1f} GB/s of weights + KV read / {r['copy_bandwidth_gbs']:.1f} GB/s copy bandwidth = {r['decode_bytes_over_bandwidth']:.1%}")
    print(f"engine metrics  : {json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in m.items()})}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="weights, activations and KV cache, both sides (bf16: the CPU fast path on AMX)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto")
    ap.add_argument("--threads", type=int, default=0, help="torch threads for both sides (0 = torch default)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "engine_vs_hf.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = load_model(args.model, dtype=args.dtype, device=args.device).eval()
    result = {"model": args.model, **compare(model, load_tokenizer(args.model), args.prompts, args.samples, args.new_tokens, args.repeats)}
    report(result, args.dtype)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
