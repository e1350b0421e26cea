"""The engine's decode attention alone vs torch SDPA over the same KV, same run: µs per layer, FLOP/s over peak.

    .venv/bin/python benchmarks/engine_attention.py [--prompt-lens 37,38,39,31,46,39,47,35] [--samples 8]
        [--own 0,32,63] [--heads 9] [--kv-heads 3] [--head-dim 64] [--layers 30] [--dtype bfloat16|float32] [--reps 300]

One decode step's attention in one layer, at engine_vs_hf.py's shape by default (SmolLM2-135M's heads, its 8 chat
prompts' lengths, 8 samples each), after each sample has generated `own` tokens (one row per `--own` value):

  posttrain: `cpu_kernels.group_attention` over the group KV (each prompt's keys once per group, then the samples'
             own keys interleaved), writing the new token's k/v first, as a decode step does;
  torch SDPA: what HF's decode runs, one `scaled_dot_product_attention` call on (B, H, 1, D) queries over each
             sample's own contiguous cache (B, KV, L, D), padded to the longest context with a boolean mask,
             GQA by `enable_gqa`.

FLOPs = 4 · heads · head_dim · context per query row (q·k and p·v), the count engine_vs_hf.py's decode uses; the
peak is engine_vs_hf.matmul_peak, measured right before and after (the higher). The KV is hot (the same layer
each call): in a real step it comes from memory after the weights have streamed through the cache. The two outputs
are compared (max abs difference) so the timing is of the same result.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from engine_vs_hf import matmul_peak

from posttrain.ops import cpu_kernels


def make_step(prompt_lens: list[int], samples: int, own: int, H: int, KV: int, D: int, dtype: torch.dtype, seed: int = 0):
    """Both layouts of one layer's KV after `own` generated tokens per sample, plus this step's q/k/v.
    Group layout: (groups, KV, cap, D), prompt g at [0, P), sample m's token j at P + j*W + m. Per-sample layout:
    (B, KV, Lmax, D), sample b's context [prompt, own tokens, new token] contiguous, the rest masked."""
    g = torch.Generator().manual_seed(seed)
    W, G8, B = samples, len(prompt_lens), len(prompt_lens) * samples
    P = torch.tensor(prompt_lens)
    rand = lambda *s: torch.randn(*s, generator=g).to(dtype)
    prompt_k = [rand(KV, p, D) for p in prompt_lens]
    prompt_v = [rand(KV, p, D) for p in prompt_lens]
    own_k, own_v = rand(B, KV, own, D), rand(B, KV, own, D)
    q, k, v = rand(B, H, D), rand(B, KV, D), rand(B, KV, D)
    cap = max(prompt_lens) + W * (own + 1)
    kc, vc = torch.zeros(G8, KV, cap, D, dtype=dtype), torch.zeros(G8, KV, cap, D, dtype=dtype)
    Lmax = max(prompt_lens) + own + 1
    ks, vs = torch.zeros(B, KV, Lmax, D, dtype=dtype), torch.zeros(B, KV, Lmax, D, dtype=dtype)
    mask = torch.zeros(B, 1, 1, Lmax, dtype=torch.bool)
    for b in range(B):
        gi, m, p = b // W, b % W, prompt_lens[b // W]
        kc[gi, :, :p], vc[gi, :, :p] = prompt_k[gi], prompt_v[gi]
        kc[gi, :, p + m: p + m + W * own: W], vc[gi, :, p + m: p + m + W * own: W] = own_k[b], own_v[b]
        ks[b, :, :p], vs[b, :, :p] = prompt_k[gi], prompt_v[gi]
        ks[b, :, p:p + own], vs[b, :, p:p + own] = own_k[b], own_v[b]
        ks[b, :, p + own], vs[b, :, p + own] = k[b], v[b]
        mask[b, ..., :p + own + 1] = True
    rows = torch.arange(B)
    group = dict(q=q, k=k, v=v, k_cache=kc, v_cache=vc, member=rows.view(G8, W).clone(),
                 off=P[rows // W] + own * W + rows % W, prompt=P)
    sdpa = dict(q=q.unsqueeze(2), k=ks, v=vs, mask=mask)
    flops = sum(4 * H * D * (p + own + 1) * W for p in prompt_lens)
    return group, sdpa, flops


def best_us(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e6


def compare(prompt_lens, samples, own, H, KV, D, dtype, reps) -> dict:
    group, sdpa, flops = make_step(prompt_lens, samples, own, H, KV, D, dtype)
    scale = D ** -0.5
    ours = lambda: cpu_kernels.group_attention(**group, scale=scale, window=None)
    theirs = lambda: F.scaled_dot_product_attention(sdpa["q"], sdpa["k"], sdpa["v"], attn_mask=sdpa["mask"],
                                                    scale=scale, enable_gqa=True)
    diff = (ours().float() - theirs().reshape(len(prompt_lens) * samples, H * D).float()).abs().max().item()
    peaks = [matmul_peak(dtype)]
    t_ours, t_sdpa = best_us(ours, reps), best_us(theirs, reps)
    peaks.append(matmul_peak(dtype))
    peak = max(peaks)
    return {"own": own, "ours_us": t_ours, "sdpa_us": t_sdpa, "flops": flops, "peak": peak, "max_abs_diff": diff,
            "ours_over_peak": flops / (t_ours * 1e-6) / peak, "sdpa_over_peak": flops / (t_sdpa * 1e-6) / peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-lens", default="37,38,39,31,46,39,47,35")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--own", default="0,32,63", help="generated tokens per sample before the step, comma-separated")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30, help="to state the per-step total")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--reps", type=int, default=300)
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    if not cpu_kernels.group_attention_runs(torch.device("cpu"), dtype, a.head_dim):
        raise SystemExit("group_attention does not run here (needs the CPU kernels: x86-64 with AVX2, GCC >= 12 or Clang)")
    lens = [int(x) for x in a.prompt_lens.split(",")]
    print(f"{len(lens)} prompts x {a.samples} samples, heads {a.heads}/{a.kv_heads} x {a.head_dim}, {a.dtype}, "
          f"threads {torch.get_num_threads()}; per layer, KV hot")
    for own in (int(x) for x in a.own.split(",")):
        r = compare(lens, a.samples, own, a.heads, a.kv_heads, a.head_dim, dtype, a.reps)
        print(f"own {own:3d}: posttrain {r['ours_us']:7.1f} us ({r['ours_over_peak']:5.1%} of {r['peak'] / 1e9:.0f} GFLOP/s)  "
              f"SDPA {r['sdpa_us']:7.1f} us ({r['sdpa_over_peak']:5.1%})  ratio {r['sdpa_us'] / r['ours_us']:.2f}x  "
              f"x{a.layers} layers: {r['ours_us'] * a.layers / 1e3:.2f} vs {r['sdpa_us'] * a.layers / 1e3:.2f} ms/step  "
              f"max |diff| {r['max_abs_diff']:.2g}")


if __name__ == "__main__":
    main()
