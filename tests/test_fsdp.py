"""FSDP2 on CPU with gloo (posttrain/systems/fsdp.py, posttrain/systems/dist.py): 2 ranks give the loss,
gradient norm and updated weights of 1 rank on the same global batch for SFT steps, and a distributed
checkpoint written at 2 ranks resumes at 1 (tests/fsdp_scenarios.py holds the scenarios); the SFT, DPO and
RL recipes (GRPO, PPO) under torchrun give one process's run, survive a killed rank and resume at 1.
Run by `make test-dist`."""

import json
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.dist


def _worker(rank: int, world: int, init_file: str, out: str) -> None:
    import faulthandler

    import torch.distributed as dist

    import fsdp_scenarios
    from posttrain.systems.dist import DistInfo, gather_objects, global_sum

    faulthandler.enable()  # a native abort prints every thread's Python stack
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    info = DistInfo(rank, world)
    assert gather_objects({"rank": rank}, info) == [{"rank": r} for r in range(world)]
    assert global_sum([1.0, rank], info) == [world, sum(range(world))]
    res = fsdp_scenarios.distributed(info, fsdp_scenarios.Path(out) / "sft")
    if rank == 0:
        torch.save(res, f"{out}/sft.pt")
    dist.barrier()
    dist.destroy_process_group()
    # Skip interpreter finalisation: a gloo object that outlives destroy_process_group can abort in its C++
    # destructor at exit ("terminate called without an active exception"), after every result is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn_two_ranks(out) -> None:
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: loopback, whatever the hostname resolves to
    mp.spawn(_worker, args=(2, str(out / "init"), str(out)), nprocs=2, join=True)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Runs the SFT scenario at 2 ranks. A rank killed by a signal (a native abort inside gloo, not a Python
    error and not a wrong number) gets one rerun in a fresh directory, with the first failure printed."""
    from torch.multiprocessing import ProcessExitedException

    out = tmp_path_factory.mktemp("fsdp")
    try:
        _spawn_two_ranks(out)
    except ProcessExitedException as e:
        if e.signal_name is None:
            raise
        print(f"two-rank run died by {e.signal_name}: {e}; rerunning once", file=sys.stderr)
        out = tmp_path_factory.mktemp("fsdp_rerun")
        _spawn_two_ranks(out)
    return out


def test_two_ranks_equal_one_rank_and_resume_at_one(two_ranks):
    import fsdp_scenarios

    dist_res = torch.load(two_ranks / "sft.pt", weights_only=False)
    state = json.loads((two_ranks / "sft" / "state.json").read_text())
    assert state == {"step": fsdp_scenarios.STEPS - 1, "world_size": 2}
    diff = fsdp_scenarios.differences(dist_res, fsdp_scenarios.single(), fsdp_scenarios.resumed(two_ranks / "sft"))
    print("sft", diff)
    assert fsdp_scenarios.within(diff), diff
    assert len(dist_res["losses"]) == fsdp_scenarios.STEPS and all(x > 0 for x in dist_res["grad_norms"])


def test_rank_share_pads_with_weight_zero():
    from posttrain.systems.dist import DistInfo, rank_share

    items = ["a", "b", "c"]
    assert rank_share(items, DistInfo(0, 2)) == [("a", 1.0), ("c", 1.0)]
    assert rank_share(items, DistInfo(1, 2)) == [("b", 1.0), ("a", 0.0)]
    assert rank_share(items, DistInfo(0, 1)) == [("a", 1.0), ("b", 1.0), ("c", 1.0)]


def test_one_process_needs_no_process_group():
    from posttrain.systems.dist import DistInfo, barrier, gather_objects, global_sum

    info = DistInfo()
    assert info.main and gather_objects("x", info) == ["x"] and global_sum([2.0, 3.0], info) == [2.0, 3.0]
    barrier(info)


def test_sft_update_through_an_fsdp_root_equals_the_plain_model():
    """recipes/sft.py::accumulate_gradients (the one SFT update path) gives the same loss and gradient on a
    Sharded wrapper (world 1: every micro-batch, weight 1) as on the plain model."""
    import fsdp_scenarios
    from posttrain.models.loading import load_model, load_tokenizer
    from posttrain.recipes.sft import accumulate_gradients
    from posttrain.systems.fsdp import Sharded

    tok = load_tokenizer("tiny-random")
    batches = fsdp_scenarios.sft_batches(tok)
    a, b = load_model("tiny-random", seed=0), load_model("tiny-random", seed=0)
    loss_a = accumulate_gradients(a, batches)
    loss_b = accumulate_gradients(Sharded(b), batches)
    assert loss_b == pytest.approx(loss_a, rel=1e-6)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(pa.grad, pb.grad, rtol=1e-5, atol=1e-8), name


# ---------------------------------------------------------------- the SFT and DPO recipes under torchrun

COMMON = ["model=tiny-random", "max_steps=6", "save_every=2", "progress=false", "resume=true"]
RECIPE_ARGS = {
    "sft": ["sft", "data=arithmetic", "batch_size=4", "micro_batch_size=1"],
    "dpo": ["dpo", "batch_size=8", "micro_batch_tokens=256", "optim.lr=1e-3", "optim.warmup_steps=1", "eval_every=0",
            "length_probe.prompts=0", "eval_fraction=0.25"],
    "rl": ["rl", "prompts_per_step=4", "group_size=4", "max_new_tokens=12", "optim.lr=2e-2", "beta=0.05"],
    "ppo": ["rl", "algo=ppo", "prompts_per_step=4", "group_size=2", "max_new_tokens=12", "optim.lr=2e-3", "beta=0.05"],
}
SPACES = "def space_share(prompts, completions, **kw):\n    return [c.count(' ') / max(len(c), 1) for c in completions]\n"


def _data(recipe, tmp_path) -> list[str]:
    from conftest import COUNT_PROMPTS, write_jsonl
    from preference_synthetic import rule_pairs

    if recipe == "dpo":
        return [f"data={write_jsonl(tmp_path / 'pairs.jsonl', rule_pairs(64))}"]
    if recipe in ("rl", "ppo"):  # a dense reward the tiny model can move (a file reward: the ranks are new processes)
        (tmp_path / "spaces.py").write_text(SPACES)
        return [f"data={write_jsonl(tmp_path / 'prompts.jsonl', COUNT_PROMPTS)}", f"reward={tmp_path / 'spaces.py'}:space_share"]
    return []


def _posttrain(recipe, out, data, *launcher, env=None):
    """Run `posttrain <recipe>` under `launcher`. A torchrun run whose rank died by SIGABRT (a native abort
    inside gloo, as CI saw once; not a Python error, not a wrong number) is rerun once from scratch."""
    import shutil
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **(env or {})}
    cmd = [*launcher, "-m", "posttrain", *RECIPE_ARGS[recipe], *COMMON, f"output_dir={out}", *data]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if res.returncode != 0 and len(launcher) > 1 and "SIGABRT" in res.stderr:
        print(f"{out.name}: a rank died by SIGABRT; rerunning once:\n{res.stderr[-2000:]}", file=sys.stderr)
        shutil.rmtree(out, ignore_errors=True)
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def _final(run):
    from safetensors.torch import load_file

    return load_file(run / "final" / "model.safetensors")


def _losses(run):
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.parametrize("recipe", ["sft", "dpo", "rl", "ppo"])
def test_recipe_under_torchrun(tmp_path, recipe):
    """`torchrun -m posttrain sft|dpo|rl` (GRPO, and PPO with its value model) at 2 ranks: the losses and final weights of one process (fp32
    summation order); a rank killed after step 5 (POSTTRAIN_FAIL_AT) is restarted by torchrun and the run
    resumes from the step-4 distributed checkpoint to the very same weights; that checkpoint also resumes
    in one process."""
    import shutil

    import fsdp_scenarios
    from posttrain.models.loading import load_model
    from posttrain.systems.faults import EXIT_CODE

    data = _data(recipe, tmp_path)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    _posttrain(recipe, tmp_path / "one", data, sys.executable)
    _posttrain(recipe, tmp_path / "two", data, *torchrun)
    killed = _posttrain(recipe, tmp_path / "killed", data, *torchrun, "--max-restarts", "1",
                        env={"POSTTRAIN_FAIL_AT": "1:5"})
    one, two, again = (_final(tmp_path / n) for n in ("one", "two", "killed"))

    assert f"exitcode: {EXIT_CODE}" in killed.stderr, killed.stderr[-2000:]
    assert (tmp_path / "killed" / ".failed-rank1-step5").exists()
    assert (tmp_path / "two" / "checkpoints" / "step-4" / "dcp").is_dir()
    init = {n: p.detach() for n, p in load_model("tiny-random", seed=0).named_parameters()}
    assert max(abs(a - b) for a, b in zip(_losses(tmp_path / "one").values(), _losses(tmp_path / "two").values())) < 1e-4
    assert sorted(two) == sorted(one) and fsdp_scenarios.update_difference(two, one, init) < 1e-4  # measured ~1e-6
    assert _losses(tmp_path / "killed") == _losses(tmp_path / "two")  # steps 1..6, each once
    assert all(torch.equal(two[k], again[k]) for k in two)

    # each step is also a model folder gathered from the shards (checkpoints/step-N/model.safetensors)
    from safetensors.torch import load_file

    step6 = load_file(tmp_path / "two" / "checkpoints" / "step-6" / "model.safetensors")
    assert sorted(step6) == sorted(two) and all(torch.equal(step6[k], two[k]) for k in two)
    assert (tmp_path / "two" / "checkpoints" / "step-4" / "tokenizer_config.json").is_file()
    shutil.rmtree(tmp_path / "two" / "checkpoints" / "step-6")  # resume the step-4 DCP checkpoint at world size 1
    shutil.rmtree(tmp_path / "two" / "final")
    _posttrain(recipe, tmp_path / "two", data, sys.executable)
    assert fsdp_scenarios.update_difference(_final(tmp_path / "two"), two, init) < 1e-4
    if recipe == "ppo":  # the value model: checkpointed sharded, gathered into final/value/
        from transformers import AutoModelForSequenceClassification

        assert (tmp_path / "killed" / "checkpoints" / "step-4" / "value" / "dcp").is_dir()
        values = [AutoModelForSequenceClassification.from_pretrained(tmp_path / n / "final" / "value").score.weight
                  for n in ("one", "killed")]
        assert torch.allclose(values[0], values[1], rtol=1e-3, atol=1e-5)
