"""Ray placement on a local CPU cluster (posttrain/recipes/rl/ray_cluster.py), `ray.init(num_cpus=2)`:
synchronous mode matches the single-process run, async mode keeps staleness <= k on every consumed
sample, and a killed rollout worker is restarted without losing or double-counting a group."""

import json

import pytest

from conftest import COUNT_PROMPTS, write_jsonl

pytestmark = pytest.mark.dist
ray = pytest.importorskip("ray")

REWARD = '''
def space_share(prompts, completions, **kw):
    return [c.count(" ") / max(len(c), 1) for c in completions]
'''


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _cfg(tmp_path, name, *extra):
    from posttrain.config import parse_args
    from posttrain.recipes import rl

    (tmp_path / "reward.py").write_text(REWARD)  # a file reward: the Ray workers load it by path
    data = write_jsonl(tmp_path / "prompts.jsonl", COUNT_PROMPTS)
    return parse_args(rl.RLConfig, [
        "model=tiny-random", f"data={data}", f"output_dir={tmp_path / name}", f"reward={tmp_path / 'reward.py'}:space_share",
        "prompts_per_step=4", "group_size=4", "max_new_tokens=12", "optim.lr=2e-2", "progress=false", "beta=0", *extra])


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_sync_mode_on_ray_matches_single_process(cluster, tmp_path):
    from posttrain.recipes import rl

    rl.train(_cfg(tmp_path, "local", "max_steps=3", "tis_cap=2"))
    summary = rl.train(_cfg(tmp_path, "ray", "max_steps=3", "cluster=ray"))
    for a, b in zip(_rows(tmp_path / "local"), _rows(tmp_path / "ray")):
        assert a["reward/mean"] == b["reward/mean"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-9)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)
        assert b["async/staleness/max"] == 0
    assert summary["ray_rollout_restarts"] == 0


def test_async_on_ray_staleness_and_killed_worker(cluster, tmp_path):
    """k = 1 on Ray; after step 2 the rollout actor is killed (Ray restarts it). Every consumed sample
    has staleness <= 1, every step gets its B groups, the ledger never sees a group twice (it raises)."""
    from posttrain.recipes import rl

    cfg = _cfg(tmp_path, "async", "max_steps=5", "cluster=ray", "async_rl=true", "max_staleness=1")
    run = rl.setup(cfg)
    ages, groups = [], []
    try:
        for step in range(cfg.max_steps):
            row = rl.rl_step(run, step)
            assert row["async/staleness/max"] <= 1
            ages.append(row["async/staleness/max"])
            groups.append(row["samples"] // cfg.group_size)
            if step == 1:
                ray.kill(run.rollout.producer.actor, no_restart=False)
        summary = rl.finish(run)
    finally:
        run.rollout.close()
    assert groups == [4] * 5
    assert summary["ray_rollout_restarts"] >= 1
    assert sum(summary["async_staleness_hist"].values()) == 5 * 16
    assert max(int(k) for k in summary["async_staleness_hist"]) <= 1
