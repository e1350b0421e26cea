"""Ranks, process groups and what the ranks share, for runs launched by `torchrun` (or Ray-launched ranks that
set the same environment). World size 1 (a plain process) needs no process group: every function here is
then a no-op or the identity.

    DistInfo        this process's rank and the world size (`.main`: rank 0)
    init_from_env   the process group from torchrun's environment (gloo on CPU, NCCL on GPUs)
    rank_device     the device a rank trains on (cuda:LOCAL_RANK on GPUs)
    rank_share      this rank's share of a global list of micro-batches, padded with weight-0 copies so that
                    every rank runs the same number of forwards (sharded forwards are collectives)
    global_sum      Σ over ranks of a few local numbers, in one all-reduce
    gather_objects  [obj of rank 0, obj of rank 1, …] on every rank (pickled; small things only)
    barrier         wait for every rank
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from posttrain.errors import UserError


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
    if world > 1 and not tdist.is_initialized():
        if torch.cuda.is_available():  # one GPU per rank: "cuda" means this rank's
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # NCCL for CUDA tensors, gloo for the few CPU ones (counts, gathered objects)
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        tdist.init_process_group(backend, store=_attempt_store(), rank=int(os.environ["RANK"]), world_size=world)
    if tdist.is_initialized():
        return DistInfo(tdist.get_rank(), tdist.get_world_size())
    return DistInfo()


def _attempt_store():
    """torchrun's key-value store, with a prefix per restart attempt: after `--max-restarts` restarts the
    workers, the previous attempt's keys (the old ranks' addresses) are still in the agent's store, and a
    new rank that reads one connects to a dead or reused port (seen: refused connections, hangs)."""
    from datetime import timedelta

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    # the agent hosts the store (torchrun's default rendezvous), else rank 0 does (static rendezvous, Ray)
    host = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and os.environ["RANK"] == "0"
    store = tdist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                           is_master=host, timeout=timedelta(minutes=10))
    return tdist.PrefixStore(f"posttrain/attempt-{attempt}", store)


def rank_device(device: torch.device, info: DistInfo) -> torch.device:
    """Under torchrun on GPUs each rank trains on its own: cuda:LOCAL_RANK (the device index is the rank's)."""
    if info.world == 1:
        return device
    if torch.cuda.is_available() and device.type != "cuda":
        raise UserError(f"device={device}: under torchrun on a machine with GPUs the ranks train on their GPUs "
                        "(device=auto or cuda)")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if device.type == "cuda" else device


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
        tdist.all_reduce(t)
    return t.tolist()


def gather_objects(obj, info: DistInfo) -> list:
    """[obj of rank 0, obj of rank 1, …] on every rank (pickled; small things only)."""
    if info.world == 1:
        return [obj]
    out: list = [None] * info.world
    tdist.all_gather_object(out, obj)
    return out


def barrier(info: DistInfo) -> None:
    if info.world > 1:
        tdist.barrier()
