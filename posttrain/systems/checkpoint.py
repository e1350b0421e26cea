"""Checkpoints: a loadable model folder, and everything needed to resume exactly beside it (optimizer,
scheduler, RNG, data position).

Layout of checkpoints/step-N/, given the tokenizer (every recipe passes it):
    full fine-tuning   config.json, model.safetensors, tokenizer files (what `save_pretrained` writes:
                       `AutoModelForCausalLM.from_pretrained(step-N)`, or the *ForSequenceClassification
                       folder of a reward model), optimizer.pt, scheduler.pt, rng.pt, state.json.
                       Resume reads the weights back from model.safetensors: they are stored once.
    LoRA               adapter_config.json, adapter_model.safetensors, tokenizer files (a PEFT adapter:
                       `AutoModelForCausalLM.from_pretrained(step-N)` loads its base, then it), plus
                       weights.safetensors (the trainable tensors under their training names, what resume
                       reads: the adapter stored twice, megabytes), optimizer.pt, scheduler.pt, rng.pt, state.json.
Without a tokenizer, or when the saved model's names do not cover every trained tensor (a model whose
`save_pretrained` renames weights), weights.safetensors is written too and resume reads it.
state.json is written last: a folder without it is incomplete and ignored. The folder is written
under a temporary name and renamed, so an interruption never leaves a half checkpoint in place.

A run sharded over W ranks (torchrun + FSDP2, posttrain/systems/fsdp.py) writes the weights and the
optimizer as a distributed checkpoint (fsdp.save_dcp): checkpoints/step-N/{dcp/, scheduler.pt, rng.pt,
state.json}, plus the gathered model folder as above (the weights stored twice: DCP for resume at any world
size, one process included, the folder for `from_pretrained`).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from posttrain.errors import UserError
from posttrain.systems.dist import barrier
from posttrain.systems.fsdp import load_dcp, save_dcp, save_full


def trainable_state(model) -> dict[str, torch.Tensor]:
    """Only what the optimizer changes (all weights for full fine-tuning, the adapter under LoRA)."""
    return {n: p.detach().contiguous().clone() for n, p in model.named_parameters() if p.requires_grad}


def all_weights(model) -> dict[str, torch.Tensor]:
    """Every parameter, trained or frozen (an extra without an optimizer: online DPO's moving reference)."""
    return {n: p.detach().contiguous().clone() for n, p in model.named_parameters()}


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_initialized():  # GPU generators (dropout, sampling on CUDA), one per device
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config")


def _saved_names(folder: Path) -> set[str]:
    """Tensor names in a model folder's safetensors files (one file or the shards of an index)."""
    names: set[str] = set()
    for file in sorted(folder.glob("model*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return names


def save_model_folder(model, tok, path: Path) -> bool:
    """`save_pretrained` of the model and tokenizer into `path` (a PEFT model: its adapter). True when the
    folder's weights hold every trained tensor under its training name, so resume can read them from it."""
    model.save_pretrained(path)
    tok.save_pretrained(path)
    if _is_peft(model):
        return False
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    return trained <= _saved_names(path)


def save_checkpoint(run_dir: Path, step: int, model, optimizer, scheduler, state: dict, keep: int = 2,
                    extras: dict | None = None, dist_info=None, tok=None) -> Path:
    """`extras`: name -> (module, optimizer or None) saved beside the policy (PPO's value model and its optimizer;
    a frozen module without one, e.g. online DPO's moving reference: all its weights). With `dist_info`
    (a sharded run) every rank calls this: the shards go to a distributed checkpoint. With `tok` the folder
    is also a model folder (`from_pretrained(step-N)`)."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{step}"
    tmp = root / f".step-{step}.tmp"
    if dist_info is not None:
        return _save_sharded(run_dir, final, tmp, model, optimizer, scheduler, {"step": step, **state}, keep, dist_info,
                             extras, tok)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if tok is None or not save_model_folder(model, tok, tmp):
        save_file(trainable_state(model), tmp / "weights.safetensors")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    for name, (module, opt) in (extras or {}).items():
        save_file(trainable_state(module) if opt is not None else all_weights(module), tmp / f"{name}.safetensors")
        if opt is not None:
            torch.save(opt.state_dict(), tmp / f"{name}_optimizer.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _save_sharded(run_dir: Path, final: Path, tmp: Path, model, optimizer, scheduler, state: dict, keep: int,
                  info, extras: dict | None = None, tok=None) -> Path:
    """Rank 0 writes scheduler, RNG, the gathered model folder (with `tok`; the gather is a collective) and
    (last, after every rank's shards) state.json, then renames. `extras` (PPO's value model and its optimizer)
    go to their own distributed checkpoints, <name>/."""
    if info.main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(rng_state(), tmp / "rng.pt")
    barrier(info)
    if tok is not None:
        save_full(model, tok, tmp, info)
    for name, (module, opt) in (extras or {}).items():
        save_dcp(tmp / name, module, opt, {}, info)
    save_dcp(tmp, model, optimizer, state, info)  # barrier after the shards, then state.json on rank 0
    if info.main:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    barrier(info)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.glob("step-*") if (p / "state.json").is_file()]
    return sorted(done, key=lambda p: int(p.name.split("-")[1]))


def load_checkpoint(path: Path, model, optimizer, scheduler, extras: dict | None = None) -> dict:
    """Restore everything in place; returns state.json (step, data position, ...). A distributed checkpoint
    loads into a sharded model at any world size, or into a plain model."""
    if (path / "dcp").is_dir():
        return _load_sharded(path, model, optimizer, scheduler, extras)
    if any(hasattr(p, "full_tensor") for p in model.parameters()):
        raise UserError(f"{path} was written by one process: resume it with one process (a checkpoint written "
                        "under torchrun resumes at any world size, one process included)")
    if (path / "weights.safetensors").is_file():
        _load_weights(path / "weights.safetensors", model)
    else:
        _load_folder_weights(path, model)
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    for name, (module, opt) in (extras or {}).items():
        if not (path / f"{name}.safetensors").is_file():
            raise UserError(f"{path} holds no {name} model (the run that wrote it had none, e.g. another algo): resume "
                            "with the run's own config, or start a new run in another output_dir")
        _load_weights(path / f"{name}.safetensors", module)
        if opt is not None:
            opt.load_state_dict(torch.load(path / f"{name}_optimizer.pt", weights_only=False))
    set_rng_state(torch.load(path / "rng.pt", weights_only=False))
    return json.loads((path / "state.json").read_text())


def _load_sharded(path: Path, model, optimizer, scheduler, extras: dict | None) -> dict:
    for name, (module, opt) in (extras or {}).items():
        if not (path / name / "state.json").is_file():
            raise UserError(f"{path}: this distributed checkpoint holds no {name} model")
        load_dcp(path / name, module, opt)
    state = load_dcp(path, model, optimizer)
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    set_rng_state(torch.load(path / "rng.pt", weights_only=False))
    return state


def _load_weights(file: Path, model) -> None:
    path = file.parent
    weights = load_file(file)
    params = dict(model.named_parameters())
    missing = [n for n in weights if n not in params]
    if missing:
        raise UserError(f"{path}: the checkpoint has parameters the model lacks: {missing[:3]} (it was written for "
                        "another model or LoRA setting): resume with the run's own config")
    _check_shapes(path, weights, params)
    with torch.no_grad():
        for n, t in weights.items():
            params[n].copy_(t)


def _load_folder_weights(path: Path, model) -> None:
    """The trained weights from the checkpoint's model folder (model*.safetensors, as save_pretrained wrote them)."""
    params = dict(model.named_parameters())
    names = _saved_names(path)
    missing = [n for n, p in params.items() if p.requires_grad and n not in names]
    if missing:
        raise UserError(f"{path}: the checkpoint lacks trained weights {missing[:3]} (neither weights.safetensors "
                        "nor model.safetensors holds them)")
    with torch.no_grad():
        for file in sorted(path.glob("model*.safetensors")):
            weights = {n: t for n, t in load_file(file).items() if n in params}
            _check_shapes(path, weights, params)
            for n, t in weights.items():
                params[n].copy_(t)


def _check_shapes(path: Path, weights: dict, params: dict) -> None:
    """A checkpoint of another model (same names, other sizes) is refused, naming the first tensor."""
    for n, t in weights.items():
        if tuple(t.shape) != tuple(params[n].shape):
            raise UserError(f"{path}: tensor {n} is {tuple(t.shape)} in the checkpoint but {tuple(params[n].shape)} in the "
                            "model (the checkpoint was written for another model): resume with the run's own model")
