"""Sharded data-parallel training with PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`), launched by
`torchrun` (or Ray-launched ranks that set the same environment), and distributed checkpoints with
`torch.distributed.checkpoint` (DCP) that resume at another world size.

One optimizer step over a global batch of micro-batches, world size W:

    share      rank r takes micro-batches r, r + W, r + 2W, …; a rank with fewer than ⌈M/W⌉ runs a
               weight-0 copy of micro-batch 0 so that every rank does the same forwards (each forward
               all-gathers the layers' shards: unequal counts would hang)
    normalise  the loss normaliser (loss tokens, sequences) is summed over ranks ONCE (one all-reduce of
               the local counts); each rank's loss is  Σ_local ℓ / N_global
    backward   FSDP2 reduce-scatters the gradients as a MEAN over ranks (gloo has no pre-multiplied sum
               for `set_gradient_divide_factor(1)`), so each rank backpropagates W × its loss: the mean
               of W × (Σ_local ℓ / N_global) is the sum. Without the factor the step would shrink by W;
               with an extra all-reduce of the loss it would grow by W
    update     clip_grad_norm_ (the global norm, computed over DTensor shards), AdamW on the shards

so W ranks produce the gradient of the single-rank step on the same global batch, up to summation
order. Every lm_head/loss computation runs inside the FSDP root's forward (`Sharded.forward(fn, …)`),
so the root's parameters (embeddings, final norm, tied lm_head) are gathered when the loss reads them.

Checkpoints: `save_dcp` writes the model's and optimizer's sharded state (fully-qualified names of the
unwrapped model) plus a JSON state; `load_dcp` reads it into a sharded or a plain model, at any world
size (DCP reshards on load; world size 1 needs no process group).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from posttrain.errors import UserError
from posttrain.models.forward import unwrap
from posttrain.training.optim import optimizer_step


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_from_env() -> DistInfo:
    """torchrun sets WORLD_SIZE / RANK / MASTER_ADDR; gloo on CPU, NCCL on GPUs. World size 1: no group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        if torch.cuda.is_available():  # one GPU per rank: "cuda" means this rank's
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # NCCL for CUDA tensors, gloo for the few CPU ones (counts, gathered objects)
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=_attempt_store(), rank=int(os.environ["RANK"]), world_size=world)
    if dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size())
    return DistInfo()


def _attempt_store():
    """torchrun's key-value store, with a prefix per restart attempt: after `--max-restarts` restarts the
    workers, the previous attempt's keys (the old ranks' addresses) are still in the agent's store, and a
    new rank that reads one connects to a dead or reused port (seen: refused connections, hangs)."""
    from datetime import timedelta

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    # the agent hosts the store (torchrun's default rendezvous), else rank 0 does (static rendezvous, Ray)
    host = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and os.environ["RANK"] == "0"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=host, timeout=timedelta(minutes=10))
    return dist.PrefixStore(f"posttrain/attempt-{attempt}", store)


def rank_device(device: torch.device, info: DistInfo) -> torch.device:
    """Under torchrun on GPUs each rank trains on its own: cuda:LOCAL_RANK (the device index is the rank's)."""
    if info.world == 1:
        return device
    if torch.cuda.is_available() and device.type != "cuda":
        raise UserError(f"device={device}: under torchrun on a machine with GPUs the ranks train on their GPUs "
                        "(device=auto or cuda)")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if device.type == "cuda" else device


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


def rank_share(items: list, info: DistInfo) -> list[tuple[object, float]]:
    """(item, weight) pairs of this rank: items[rank::world], padded with (items[0], 0.0) to ⌈len/world⌉."""
    if not items:
        raise ValueError("no micro-batches to share")
    per = -(-len(items) // info.world)
    mine = items[info.rank::info.world]
    return [(x, 1.0) for x in mine] + [(items[0], 0.0)] * (per - len(mine))


def global_sum(values: list[float], info: DistInfo) -> list[float]:
    """Σ over ranks of a few local numbers, in one all-reduce (float64: exact for counts < 2^53)."""
    t = torch.tensor(values, dtype=torch.float64)
    if info.world > 1:
        dist.all_reduce(t)
    return t.tolist()


def barrier(info: DistInfo) -> None:
    if info.world > 1:
        dist.barrier()


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


# ---------------------------------------------------------------- SFT and RL steps


def sft_backward(step_model, local: list[tuple[object, float]], n_global: int, chunk: int = 1024,
                 mixed_precision: str = "none") -> torch.Tensor:
    """Backward of this rank's share of  −Σ log p / N_global  (recipes/sft.py::accumulate_gradients with
    the step's loss-token count summed over ranks). Returns the share of the loss (detached)."""
    from posttrain.models.forward import token_logprobs

    total = 0.0
    for b, w in local:
        logp, _ = step_model(token_logprobs, b, chunk=chunk, mixed_precision=mixed_precision)
        loss = -logp.sum() / n_global * w
        (loss * step_model.loss_scale).backward()
        total += float(loss.detach())
    return torch.tensor(total)


@torch.no_grad()
def mean_nll(step_model, batches: list, info: DistInfo, chunk: int = 1024, mixed_precision: str = "none") -> float:
    """Mean negative log-likelihood per loss token over the global list of batches (every rank runs the
    same number of forwards; the sums are reduced once)."""
    from posttrain.models.forward import token_logprobs

    total = count = 0.0
    for b, w in rank_share(batches, info):
        logp, _ = step_model(token_logprobs, b, chunk=chunk, mixed_precision=mixed_precision)
        total, count = total - w * float(logp.sum()), count + w * logp.numel()
    total, count = global_sum([total, count], info)
    return total / max(count, 1.0)


def sft_step(step_model, optimizer, batches: list, info: DistInfo, max_grad_norm: float = 1.0, chunk: int = 1024,
             mixed_precision: str = "none") -> dict:
    """One SFT optimizer step over the global list of micro-batches; every rank returns the same metrics."""
    local = rank_share(batches, info)
    n_local = sum(b.num_loss_tokens for b, w in local if w)
    (n_global,) = global_sum([n_local], info)  # the one reduction of the normaliser
    loss = sft_backward(step_model, local, int(n_global), chunk, mixed_precision)
    grad_norm = optimizer_step(step_model, optimizer, max_grad_norm)
    (loss_sum,) = global_sum([float(loss)], info)  # for the log only
    return {"loss": loss_sum, "grad_norm": float(grad_norm), "loss_tokens": int(n_global)}


def rl_step(step_model, optimizer, batches: list, info: DistInfo, loss_fn, cfg, agg: str, tis_cap: float | None = None,
            beta: float = 0.0) -> dict:
    """One on-policy policy-gradient step (recipes/rl.py::update with one epoch and one minibatch) over the
    global list of RLBatches: old log-probs = the first forward's, global token and sequence counts."""
    from posttrain.recipes import rl_phases as ph

    local = rank_share(batches, info)
    n_tok, n_seq = global_sum([sum(float(b.loss_mask.sum()) for b, w in local if w),
                               sum(float(b.valid.sum()) for b, w in local if w)], info)
    norms = {"agg": agg, "tokens": max(int(n_tok), 1), "seqs": max(int(n_seq), 1)}
    total = 0.0
    for b, w in local:
        logp, _ = step_model(ph.policy_logps, b, cfg.sampling.temperature, cfg.mixed_precision, truncated=True)
        b.old_logp = logp.detach()
        loss, _ = ph.batch_loss(logp, b, loss_fn, cfg, beta, cfg.kl_estimator, tis_cap, norms)
        (loss * (w * step_model.loss_scale)).backward()
        total += float(loss.detach()) * w
    grad_norm = optimizer_step(step_model, optimizer, cfg.optim.max_grad_norm)
    (loss_sum,) = global_sum([float(total)], info)
    return {"loss": loss_sum, "grad_norm": float(grad_norm), "loss_tokens": norms["tokens"]}


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
