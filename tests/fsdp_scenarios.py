"""FSDP2 equivalence scenarios on the tiny model: W ranks vs 1 rank on the same global batch (the SFT recipe's
update, posttrain/recipes/sft.py::accumulate_gradients, over posttrain/systems/fsdp.py), and a distributed checkpoint written at
W ranks resumed at 1. tests/test_fsdp.py runs them in 2 spawned gloo processes; alone:

    torchrun --nproc_per_node 2 tests/fsdp_scenarios.py [DIR]      # gloo on CPU, NCCL on GPUs

prints the largest differences and exits 1 when they exceed the fp32 summation-order tolerance. The RL
recipe under torchrun (GRPO, PPO) is checked end to end by tests/test_fsdp.py::test_recipe_under_torchrun.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from posttrain.recipes.sft import accumulate_gradients
from posttrain.systems.dist import DistInfo, init_from_env
from posttrain.systems.fsdp import Sharded, full_state, load_dcp, save_dcp, shard_model
from posttrain.training.optim import optimizer_step

STEPS = 3  # steps 1-2, checkpoint, step 3
LR = 0.1
# fp32: the W-rank gradient is the same sum in another order (relative differences ~1e-6). The check
# uses SGD with momentum (state that DCP must reshard, an update linear in the gradient): AdamW would
# turn rounding noise on a near-zero gradient into a ±lr step (m/√v ≈ sign g), measuring nothing.
RTOL, ATOL = 1e-4, 1e-6


def _model():
    from posttrain.models.loading import load_model

    return load_model("tiny-random", seed=0)


def _optimizer(model):
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.9, foreach=False)


def sft_batches(tok) -> list:
    """Three micro-batches of one conversation each (odd: rank 1 of 2 pads with a weight-0 copy)."""
    from posttrain.data.packing import collate
    from posttrain.data.templates import render_row

    convs = [[{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]
             for a, b in [(1, 2), (3, 4), (12, 30)]]
    samples = [render_row(tok, {"messages": c}, "conversation") for c in convs]
    return [collate([[s]], tok.pad_token_id, False, 8) for s in samples]


def sft_step(model, optimizer, batches: list, info: DistInfo) -> dict:
    """One SFT optimizer step as the recipe takes it (its update path, sharded or not)."""
    loss = accumulate_gradients(model, batches, info=info)
    return {"loss": loss, "grad_norm": float(optimizer_step(model, optimizer, max_grad_norm=1.0))}


def _run(info: DistInfo, model, optimizer, tok, steps: range, ckpt: Path | None = None) -> dict:
    losses, norms = [], []
    for step in steps:
        m = sft_step(model, optimizer, sft_batches(tok), info)
        losses.append(m["loss"])
        norms.append(m["grad_norm"])
        if ckpt is not None and step == STEPS - 2:
            save_dcp(ckpt, model, optimizer, {"step": step + 1}, info)
    return {"losses": losses, "grad_norms": norms, "weights": full_state(model.model if isinstance(model, Sharded) else model)}


def distributed(info: DistInfo, ckpt: Path) -> dict:
    """This rank's part of the W-rank run: STEPS steps, a DCP checkpoint after step STEPS - 1."""
    from posttrain.models.loading import load_tokenizer

    torch.manual_seed(0)
    model = shard_model(_model())
    return _run(info, model, _optimizer(model), load_tokenizer("tiny-random"), range(STEPS), ckpt)


def single() -> dict:
    """The 1-rank reference (plain model, no process group)."""
    from posttrain.models.loading import load_tokenizer

    model = Sharded(_model())
    return _run(DistInfo(), model, _optimizer(model), load_tokenizer("tiny-random"), range(STEPS))


def resumed(ckpt: Path) -> dict:
    """1 rank, from the W-rank checkpoint: the last step."""
    from posttrain.models.loading import load_tokenizer

    model = Sharded(_model())
    optimizer = _optimizer(model)
    state = load_dcp(ckpt, model, optimizer)
    assert state["step"] == STEPS - 1, state
    return _run(DistInfo(), model, optimizer, load_tokenizer("tiny-random"), range(STEPS - 1, STEPS))


def worst(a: dict, b: dict) -> float:
    """Largest |a − b| / (ATOL + RTOL |b|) over two state dicts (≤ 1: within the fp32 tolerances)."""
    return max(float(((a[k] - b[k]).abs() / (ATOL + RTOL * b[k].abs())).max()) for k in b)


def update_difference(a: dict, b: dict, init: dict) -> float:
    """‖a − b‖ / ‖b − init‖: how far two runs' weights are apart, relative to how far training moved them.
    Elementwise tolerances do not suit many Adam steps: an element whose gradient is summation-order noise
    is moved by ±lr either way (Adam normalises it), while the update as a whole agrees to ~1e-6."""
    num = sum(float((a[k] - b[k]).double().pow(2).sum()) for k in b)
    den = sum(float((b[k] - init[k]).double().pow(2).sum()) for k in b)
    return (num / max(den, 1e-30)) ** 0.5


def differences(dist_res: dict, ref: dict, res: dict) -> dict:
    """Largest |Δ| of the losses and the final weights: W ranks vs 1 rank, and resumed-at-1 vs W ranks."""

    return {"loss_vs_1_rank": max(abs(x - y) for x, y in zip(dist_res["losses"], ref["losses"])),
            # AdamW is invariant to the gradient's scale: the norm is what shows a step off by W
            "grad_norm_rel_vs_1_rank": max(abs(x - y) / y for x, y in zip(dist_res["grad_norms"], ref["grad_norms"])),
            "weights_vs_1_rank (in tolerances)": worst(dist_res["weights"], ref["weights"]),
            "resumed_loss_vs_W_ranks": abs(res["losses"][-1] - dist_res["losses"][-1]),
            "resumed_weights_vs_W_ranks (in tolerances)": worst(res["weights"], dist_res["weights"])}


def within(diff: dict) -> bool:
    """fp32 summation-order tolerances (measured ~2e-6 on losses of ~5, ~4e-6 relative on norms; a step off by W is 0.5 or 2)."""
    return (diff["loss_vs_1_rank"] < 1e-4 and diff["resumed_loss_vs_W_ranks"] < 1e-4 and diff["grad_norm_rel_vs_1_rank"] < 1e-4
            and diff["weights_vs_1_rank (in tolerances)"] <= 1 and diff["resumed_weights_vs_W_ranks (in tolerances)"] <= 1)


def main() -> int:
    import tempfile

    import torch.distributed as dist

    info = init_from_env()
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.gettempdir()) / "posttrain_fsdp_check"
    ok = True
    out = distributed(info, root / "sft")
    if info.main:
        diff = differences(out, single(), resumed(root / "sft"))
        ok = within(diff)
        print(f"sft: {'OK' if ok else 'MISMATCH'} at world size {info.world}: {diff}")
    if info.world > 1:
        dist.barrier()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
