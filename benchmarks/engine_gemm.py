"""The engine's linears at decode shapes: posttrain's packed GEMM vs oneDNN's packed linear vs torch's, same run.

A model's linears in decode order (every layer's q|k|v, o, gate|up, down, then the lm_head), each from its own
weight, so the weights stream from memory as in a decode step; x random rows. For each row count it times the
whole sequence with each kernel (alternating, best of --repeats) and prints GFLOP/s, the fraction of the 2048³
matmul peak in the same dtype measured in the same run, and the ratios (float32 by default; --dtype bfloat16: the
bf16 variant, vdpbf16ps on bf16 pairs, on CPUs with AVX-512 BF16):

    posttrain : cpu_kernels.gemm_packed over cpu_kernels.gemm_pack (what rollout.runner._Linear runs where
                ops.linear.ENGINE_GEMM chooses it)
    oneDNN    : torch.ops.mkldnn._linear_pointwise over mkldnn._reorder_linear_weight (batch hint 64; the engine's
                packed linear elsewhere)
    MKL       : torch.nn.functional.linear on the plain weight (torch's BLAS; in bf16 whatever torch runs)

Also the time to re-pack every weight after a weight change (posttrain: in place; oneDNN: a new reorder).
Shapes of SmolLM2-135M by default (hidden 576, MLP 1536, 30 layers, vocab 49152; --hidden/--inner/--layers/--vocab).

    .venv/bin/python benchmarks/engine_gemm.py [--rows 1 8 32 64 128 512] [--repeats 3] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from engine_vs_hf import matmul_peak

from posttrain.ops import cpu_kernels


def weights(hidden: int, inner: int, layers: int, vocab: int, heads_kv: int = 3, head_dim: int = 64) -> list[torch.Tensor]:
    """The linears of one decode step, in order, as (out, in) float32 weights."""
    qkv = hidden + 2 * heads_kv * head_dim
    shapes = [(qkv, hidden), (hidden, hidden), (2 * inner, hidden), (hidden, inner)] * layers + [(vocab, hidden)]
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, k, generator=g) * 0.02 for n, k in shapes]


def pack(w: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """posttrain's panels: float32 (gemm_pack), or bf16 pairs for vdpbf16ps (gemm_pack_bf16)"""
    return (cpu_kernels.gemm_pack_bf16 if w.dtype == torch.bfloat16 else cpu_kernels.gemm_pack)(w, into)


def kernels(ws: list[torch.Tensor]) -> dict:
    """name -> function(xs) running every linear once; xs maps in-features to an input of that width."""
    packed = [pack(w) for w in ws]
    blocked = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in ws]

    def ours(xs):
        for w, p in zip(ws, packed):
            cpu_kernels.gemm_packed(xs[w.shape[1]], p, w.shape[0])

    def onednn(xs):
        for w, b in zip(ws, blocked):
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], b, None, "none", [], "")

    def mkl(xs):
        for w in ws:
            F.linear(xs[w.shape[1]], w)

    return {"posttrain": ours, "oneDNN": onednn, "MKL": mkl}, packed


def best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 512])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--inner", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="weights and x (bfloat16: posttrain's vdpbf16ps variant, needs AVX-512 BF16)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if cpu_kernels.load() is None or not cpu_kernels.load().gemm_kernel_available():
        raise SystemExit("posttrain's packed GEMM is not built here (needs x86-64 with AVX2 and FMA)")
    if dtype == torch.bfloat16 and not cpu_kernels.load().gemm_bf16_kernel_available():
        raise SystemExit("posttrain's bf16 GEMM is not built here (needs x86-64 with AVX-512 BF16)")
    ws = [w.to(dtype) for w in weights(args.hidden, args.inner, args.layers, args.vocab)]
    fns, packed = kernels(ws)
    peak = matmul_peak(dtype)
    print(f"threads {torch.get_num_threads()}  {len(ws)} linears, {sum(w.numel() for w in ws) / 1e6:.1f}M weights  "
          f"{args.dtype} 2048³ peak {peak / 1e9:.1f} GFLOP/s")
    results = []
    for rows in args.rows:
        xs = {k: torch.randn(rows, k).to(dtype) for k in {w.shape[1] for w in ws}}
        flops = 2 * rows * sum(w.numel() for w in ws)
        secs = {name: float("inf") for name in fns}
        for _ in range(args.repeats):  # alternating: the shared machine drifts
            for name, fn in fns.items():
                secs[name] = min(secs[name], best(lambda fn=fn, xs=xs: fn(xs), 1))
        row = {"rows": rows, **{f"{n}_gflops": flops / s / 1e9 for n, s in secs.items()}}
        results.append(row)
        print(f"rows {rows:5d}  " + "  ".join(f"{n} {flops / s / 1e9:6.1f} GFLOP/s ({flops / s / peak:5.1%})" for n, s in secs.items())
              + f"  posttrain/oneDNN {secs['oneDNN'] / secs['posttrain']:.2f}x  posttrain/MKL {secs['MKL'] / secs['posttrain']:.2f}x")
    repack = best(lambda: [pack(w, p) for w, p in zip(ws, packed)], args.repeats)
    reorder = best(lambda: [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in ws], args.repeats)
    print(f"re-pack after a weight change: posttrain {repack * 1e3:.0f} ms (in place), oneDNN reorder {reorder * 1e3:.0f} ms")
    out = Path(__file__).parent / "results" / f"engine_gemm{'_bf16' if dtype == torch.bfloat16 else ''}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"dtype": args.dtype, "peak_gflops": peak / 1e9, "rows": results, "repack_s": repack, "reorder_s": reorder}, indent=1))


if __name__ == "__main__":
    main()
