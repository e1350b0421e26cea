"""SmolLM2-135M-Instruct learns to use a calculator for 3-digit × 2-digit multiplication.

    python scripts/agentic_calculator.py [--out runs/agentic_calc] [--sft-steps 4] [--rl-steps 30]

1. 400 tool-use demonstrations (posttrain/agentic/demos.py), a held-out set of 100 problems and an
   RL prompt set, drawn with different seeds (no overlap by construction of the seeds; checked).
2. eval the base model in env=calculator (n episodes per problem): success ≈ 0.
3. short SFT warm-up on the demonstrations -> eval.
4. GRPO in env=calculator from the SFT model -> eval.
5. `posttrain eval compare` SFT vs SFT+GRPO and base vs SFT+GRPO; prints success (pass@1), pass^k
   and the fraction of episodes whose calculator call returned the right product (tool_correct).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def cli(*args: str) -> None:
    from posttrain.cli import main

    print("$ posttrain " + " ".join(args), flush=True)
    rc = main(list(args))
    if rc:
        raise SystemExit(f"posttrain {args[0]} failed with status {rc}")


def summary(path: Path) -> dict:
    d = json.loads((path / "results.json").read_text())
    return {"pass@1": d["metrics"]["pass@1"]["value"], "pass@1_ci": (d["metrics"]["pass@1"]["low"], d["metrics"]["pass@1"]["high"]),
            "tool_correct": d["agent"].get("tool_correct"), "tool_calls": d["agent"]["tool_calls"],
            "turns": d["agent"]["turns"], "env_s": d["timing"]["env_s"], "model_s": d["timing"]["model_s"]}


def main() -> None:
    from posttrain.agentic.demos import demonstrations
    from posttrain.data.tasks import generate
    from posttrain.models.loading import load_tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/agentic_calc")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--demos", type=int, default=400)
    ap.add_argument("--sft-steps", type=int, default=4)  # a partial warm-up: leaves GRPO room (20 steps reach 0.99 alone)
    ap.add_argument("--sft-lr", type=float, default=5e-5)
    ap.add_argument("--rl-steps", type=int, default=30)
    ap.add_argument("--rl-lr", type=float, default=5e-6)
    ap.add_argument("--eval-items", type=int, default=100)
    ap.add_argument("--n", type=int, default=4)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(a.model)
    demos = demonstrations(tok, f"multiply_3x2:{a.demos}", seed=1, tool_format="tag")
    eval_rows, rl_rows = generate(f"multiply_3x2:{a.eval_items}", seed=99), generate("multiply_3x2:2000", seed=7)
    held = {(r["a"], r["b"]) for r in eval_rows}
    rl_rows = [r for r in rl_rows if (r["a"], r["b"]) not in held]  # no held-out problem is trained on
    write_rows(out / "demos.jsonl", [d for d in demos if not any(f"{x} * {y}" in d["messages"][-1]["content"] for x, y in held)])
    eval_data, rl_data = write_rows(out / "eval.jsonl", eval_rows), write_rows(out / "rl.jsonl", rl_rows)
    agent = ["agent.tool_format=tag", "agent.max_turns=3", "max_new_tokens=40"]
    ev = lambda model, name: cli("eval", "env=calculator", f"model={model}", f"data={eval_data}", f"n={a.n}",
                                 *agent, f"output_dir={out / name}", "seed=0")
    ev(a.model, "eval_base")
    cli("sft", f"model={a.model}", f"data={out / 'demos.jsonl'}", f"max_steps={a.sft_steps}", "batch_size=8",
        f"optim.lr={a.sft_lr}", "max_length=512", "sample_every=0", "eval_every=0", f"output_dir={out / 'sft'}", "progress=false")
    ev(out / "sft" / "final", "eval_sft")
    cli("rl", f"model={out / 'sft' / 'final'}", "env=calculator", f"data={rl_data}", *agent, "beta=0",
        "prompts_per_step=4", "group_size=8", f"max_steps={a.rl_steps}", f"optim.lr={a.rl_lr}", "mixed_precision=bf16",
        "samples_per_log=2", f"output_dir={out / 'rl'}", "progress=false")
    ev(out / "rl" / "final", "eval_rl")
    for name in ("eval_base", "eval_sft", "eval_rl"):
        print(name, summary(out / name))
    cli("eval", "compare", str(out / "eval_sft"), str(out / "eval_rl"), "allow_protocol_diff=true", f"output={out / 'compare_sft_rl.json'}")
    cli("eval", "compare", str(out / "eval_base"), str(out / "eval_rl"), "allow_protocol_diff=true", f"output={out / 'compare_base_rl.json'}")


if __name__ == "__main__":
    main()
