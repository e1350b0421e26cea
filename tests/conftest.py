import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("POSTTRAIN_NO_PROGRESS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# benchmark apparatus the tests share (simulated_device: the long-tail rollout device), importable by name
sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.fixture(scope="session")
def tiny_tok():
    from posttrain.models.loading import load_tokenizer

    return load_tokenizer("tiny-random")


def write_jsonl(path, rows):
    import json

    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def conv(*turns):
    roles = ["user", "assistant"]
    return {"messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]}


COUNT_PROMPTS = [{"prompt": [{"role": "user", "content": f"Count to {d}, please."}]} for d in range(1, 9)]


def run_rl(tmp_path, *overrides, name="run"):
    """`posttrain rl` on the tiny model over COUNT_PROMPTS; overrides come last. -> (summary, run dir)."""
    from posttrain.config import parse_args
    from posttrain.recipes import rl

    data = write_jsonl(tmp_path / "prompts.jsonl", COUNT_PROMPTS)
    cfg = parse_args(rl.RLConfig, [
        "model=tiny-random", f"data={data}", f"output_dir={tmp_path / name}", "reward=space_share",
        "prompts_per_step=4", "group_size=4", "max_new_tokens=12", "optim.lr=2e-2", "max_steps=8",
        "progress=false", *overrides,
    ])
    return rl.train(cfg), tmp_path / name


@pytest.fixture(scope="module")
def server():
    """A fake LLM judge (tests/fake_judge.py) served over HTTP, one per test module."""
    from fake_judge import FakeJudge

    fake = FakeJudge()
    with fake.serve() as srv:
        yield fake, srv


@pytest.fixture
def fake(server):
    """The module's fake judge, reset to its defaults for each test."""
    fake, srv = server
    fake.verdict, fake.malformed_first, fake.status_first, fake.status, fake.delay_s = "longer", 0, 0, 500, 0.0
    fake.requests.clear()
    fake.seen.clear()
    fake.base_url = srv.base_url
    return fake


@pytest.fixture(scope="session")
def workspace(tmp_path_factory):
    """The CLI fuzz suite's shared inputs and finished runs (tests/edges.py)."""
    from edges import Workspace

    return Workspace(tmp_path_factory.mktemp("edges"))


@pytest.fixture
def no_activation_probe(monkeypatch):
    """The planner's activation probe (training/memprobe.py, tested in tests/test_memprobe.py) runs two profiled
    passes per run: most of a tiny run's time. The CLI fuzz cases (tests/test_edges_*.py) use the plan's closed form."""
    from posttrain.recipes.rl import build
    from posttrain.training import plan

    monkeypatch.setattr(plan, "activation_fit", lambda *a, **k: None)
    monkeypatch.setattr(build, "activation_fit", lambda *a, **k: None)
