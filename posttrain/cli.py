"""`posttrain <command> [--config FILE] key=value | --key value ...` — thin: parse, build config, call a recipe.

A UserError / ConfigError prints one `error:` line and exits 2 (`--debug` or POSTTRAIN_DEBUG=1: its traceback too);
Ctrl-C prints one line naming the checkpoints kept and how to resume, and exits 130; any other exception keeps its
traceback (a bug to fix, never hidden).

Each command lives in its own module as `main(argv: list[str]) -> None`; this file only routes, so
adding a command is one line in COMMANDS and never touches another command's code.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from pathlib import Path

from posttrain.errors import UserError

# name -> ("module:function", one-line summary). The summaries are literal so that `posttrain --help` imports
# nothing heavy; tests/test_cli.py checks that the rl and dpo lists name every preset and loss of the registries.
COMMANDS: dict[str, tuple[str, str]] = {
    "sft": ("posttrain.recipes.sft:main", "supervised fine-tuning (assistant-only loss, packing, LoRA)"),
    "rl": ("posttrain.recipes.rl:main", "online RL: ppo, online_dpo, grpo, dr_grpo, dapo, gspo, cispo, rloo, reinforce_pp"),
    "rm": ("posttrain.recipes.rm:main", "reward model (Bradley–Terry scalar head); `rm probe`: length bias, best-of-N, adversarial, calibration"),
    "dpo": ("posttrain.recipes.dpo:main", "offline preference optimisation: dpo, ipo, robust_dpo, kto, orpo, simpo, rpo, dpo_norm"),
    "rs": ("posttrain.recipes.rs:main", "rejection sampling: best of N by a reward -> SFT, iterated in rounds"),
    "distill": ("posttrain.recipes.distill:main", "distillation: mode=logit (top-k teacher cache) | sequence | on_policy (GKD)"),
    "generate": ("posttrain.rollout.cli:main", "sample completions with the built-in engine, HF or vLLM"),
    "data": ("posttrain.data.cli:main", "`data export`: any data= source (task, file, Hub dataset, mixture) as a JSONL file"),
    "score": ("posttrain.rewards.cli:main", "score a file of completions with a reward or a composition"),
    "eval": ("posttrain.eval.cli:main", "pass@k, cons@k, pass^k with intervals, select=best_of_n|majority; `eval compare A B [curve=true]`; `eval contamination`; `eval rank`"),
    "plan": ("posttrain.plan.cli:main", "predict memory, tokens, FLOPs and time before a run"),
    "methods": ("posttrain.plan.methods_cli:main", "the method map: where reward, reference and value come from, models in memory"),
    "models": ("posttrain.models.cli:main", "list built-in models; `models fetch NAME` makes one available offline"),
    "quickstart": ("posttrain.recipes.quickstart:main", "eval -> GRPO -> eval -> paired test on SmolLM2-135M-Instruct, one report"),
    "report": ("posttrain.monitor.report_cli:main", "rebuild report.html of a run or quickstart folder from its files"),
    "serve": ("posttrain.rollout.serve:main", "an OpenAI-compatible server over the built-in engine (/v1/chat/completions, /v1/completions)"),
    "label": ("posttrain.eval.label:main", "preference pairs labelled by an LLM judge in both orders (RLAIF), for rm and dpo"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name.ljust(width)}  {summary}" for name, (_, summary) in COMMANDS.items())
    return (f"usage: posttrain <command> [--config FILE.yaml] [key=value | --key value ...]\n\ncommands:\n{rows}\n\n"
            "`posttrain <command> --help` lists every key with its default.")


def main(argv: list[str] | None = None) -> int:
    from posttrain.config import ConfigError  # pydantic: not needed for --help

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, list(COMMANDS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        print(f"{usage()}\n\nerror: unknown command '{name}'{hint}", file=sys.stderr)  # the error line last
        return 2
    debug = "--debug" in rest or os.environ.get("POSTTRAIN_DEBUG", "") not in ("", "0")
    rest = [a for a in rest if a != "--debug"]
    target, _ = COMMANDS[name]
    module, func = target.split(":")
    fn = getattr(importlib.import_module(module), func)
    _run_dir(clear=True)
    try:
        result = fn(rest)
    except (ConfigError, UserError) as e:
        if debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line on what is kept and how to go on (--debug: the traceback too)
        if debug:
            traceback.print_exc()
        print(f"interrupted: {interrupted_note(name, _run_dir())}", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `posttrain methods | head`: the reader left; nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    finally:
        _close_process_group()
    return int(result or 0)


def _run_dir(clear: bool = False) -> Path | None:
    """The run directory the command opened (training/run.py setup_run notes it), if it got that far."""
    run = sys.modules.get("posttrain.training.run")  # not imported: no training run was started
    if run is None:
        return None
    if clear:
        run.CURRENT.clear()
    return run.CURRENT.get("run_dir")


def interrupted_note(command: str, run_dir: Path | None) -> str:
    """What an interrupted command left: the newest complete checkpoint and the resume command."""
    if run_dir is None:
        return f"posttrain {command} stopped (Ctrl-C) before any training run started; run the same command again"
    steps = sorted(int(p.parent.name.split("-")[1]) for p in run_dir.glob("checkpoints/step-*/state.json")
                   if p.parent.name.split("-")[1].isdigit())
    if not steps:
        return (f"no checkpoint was saved in {run_dir} yet (save_every sets how often); run the same command "
                "again to start over")
    return (f"the checkpoints in {run_dir}/checkpoints are intact (newest: step-{steps[-1]}); continue with the "
            "same command and resume=true")


def _close_process_group() -> None:
    """A torchrun rank ends its process group itself (gloo threads left to interpreter exit can abort)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
