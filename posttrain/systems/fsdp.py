"""Sharded data-parallel training with PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`), and distributed
checkpoints with `torch.distributed.checkpoint` (DCP) that resume at another world size. Ranks, process
groups and the sharing of a step's micro-batches: posttrain/systems/dist.py.

One optimizer step over a global batch of micro-batches, world size W (the recipes' sharded steps):

    share      rank r takes micro-batches r, r + W, r + 2W, …; a rank with fewer than ⌈M/W⌉ runs a
               weight-0 copy of micro-batch 0 so that every rank does the same forwards (each forward
               all-gathers the layers' shards: unequal counts would hang)     (dist.rank_share)
    normalise  the loss normaliser (loss tokens, sequences) is summed over ranks ONCE (one all-reduce of
               the local counts); each rank's loss is  Σ_local ℓ / N_global      (dist.global_sum)
    backward   FSDP2 reduce-scatters the gradients as a MEAN over ranks (gloo has no pre-multiplied sum
               for `set_gradient_divide_factor(1)`), so each rank backpropagates W × its loss
               (`Sharded.loss_scale`): the mean of W × (Σ_local ℓ / N_global) is the sum. Without the
               factor the step would shrink by W; with an extra all-reduce of the loss it would grow by W
    update     clip_grad_norm_ (the global norm, computed over DTensor shards), AdamW on the shards

so W ranks produce the gradient of the single-rank step on the same global batch, up to summation
order. Every lm_head/loss computation runs inside the FSDP root's forward (`Sharded.forward(fn, …)`, or
`apply`), so the root's parameters (embeddings, final norm, tied lm_head) are gathered when the loss reads them.

Checkpoints: `save_dcp` writes the model's and optimizer's sharded state (fully-qualified names of the
unwrapped model) plus a JSON state; `load_dcp` reads it into a sharded or a plain model, at any world
size (DCP reshards on load; world size 1 needs no process group).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from posttrain.models.forward import unwrap
from posttrain.systems.dist import DistInfo


class Sharded(torch.nn.Module):
    """The FSDP root around a causal LM: `sharded(fn, *args)` runs fn(model, *args) inside the root's
    forward, with the decoder layers sharded one FSDP unit each and the rest in the root unit."""

    def __init__(self, model, world: int = 1):
        super().__init__()
        self.model = model
        self.loss_scale = float(world)  # FSDP averages gradients over ranks: W x the loss makes it a sum

    def forward(self, fn, *args, **kwargs):
        return fn(self.model, *args, **kwargs)


def apply(model, fn, *args, **kwargs):
    """fn(model, *args): inside the FSDP root's forward for a Sharded model (the root's parameters gathered),
    a plain call otherwise."""
    if isinstance(model, Sharded):
        return model(fn, *args, **kwargs)
    return fn(model, *args, **kwargs)


def shard_model(model, reshard_after_forward: bool = True, lm=None) -> Sharded:
    """Decoder layers one FSDP unit each, the rest (embeddings, norm, heads) in the root. `lm`: the causal LM
    whose layers are sharded when `model` wraps one (PPO's value model: `lm=critic.lm`)."""
    from torch.distributed.fsdp import fully_shard

    inner = unwrap(lm if lm is not None else model)
    backbone = getattr(inner, inner.base_model_prefix)
    for layer in getattr(backbone, "layers", []):
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    root = Sharded(model, dist.get_world_size() if dist.is_initialized() else 1)
    fully_shard(root, reshard_after_forward=reshard_after_forward)
    return root


def full_state(model) -> dict[str, torch.Tensor]:
    """name -> full tensor (DTensor shards gathered; a collective: every rank must call it)."""
    out = {}
    for n, p in unwrap(model).named_parameters():
        out[n] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    return out


def save_full(model, tok, path: Path, info: DistInfo) -> None:
    """final/ of a sharded run: the full weights gathered (a collective), written by rank 0 so that
    AutoModelForCausalLM.from_pretrained loads them."""
    inner = unwrap(model.model if isinstance(model, Sharded) else model)
    full = full_state(inner)
    if info.main:
        path.mkdir(parents=True, exist_ok=True)
        inner.save_pretrained(path, state_dict=full)
        tok.save_pretrained(path)


# ---------------------------------------------------------------- distributed checkpoints


def _states(model, optimizer):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    inner = model.model if isinstance(model, Sharded) else model
    return {"model": get_model_state_dict(inner), "optimizer": get_optimizer_state_dict(inner, optimizer)}


def save_dcp(path: str | Path, model, optimizer, state: dict, info: DistInfo) -> Path:
    """DCP checkpoint of the (sharded) model and optimizer + state.json (rank 0), written last."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    dcp.save(_states(model, optimizer), checkpoint_id=str(path / "dcp"))
    if info.world > 1:
        dist.barrier()
    if info.main:
        (path / "state.json").write_text(json.dumps({**state, "world_size": info.world}, indent=1))
    return path


def load_dcp(path: str | Path, model, optimizer) -> dict:
    """Load a DCP checkpoint written at any world size into this (sharded or plain) model and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    path = Path(path)
    if not (path / "state.json").is_file():
        raise FileNotFoundError(f"{path}: no state.json (not a finished distributed checkpoint)")
    inner = model.model if isinstance(model, Sharded) else model
    states = _states(model, optimizer)
    sharded = any(hasattr(p, "full_tensor") for p in inner.parameters())
    # a plain model reads alone (also on rank 0 of a process group: no collective with the other ranks)
    dcp.load(states, checkpoint_id=str(path / "dcp"), no_dist=not (dist.is_initialized() and sharded))
    set_model_state_dict(inner, states["model"])
    set_optimizer_state_dict(inner, optimizer, states["optimizer"])
    return json.loads((path / "state.json").read_text())
