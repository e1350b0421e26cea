"""report_to: metric sinks beside metrics.jsonl. TensorBoard is checked end to end with its own event reader
(tiny SFT with the eval hook, tiny RL killed and resumed); the other sinks against their libraries when
installed, and the config checks without them."""

import json
import math
import sys

import pytest

from conftest import run_rl
from posttrain.config import SINK_REQUIREMENTS, ConfigError, parse_args
from posttrain.monitor.metrics import MetricsWriter
from posttrain.monitor.sinks import mlflow_key, open_sinks
from posttrain.rewards.base import register

pytestmark = pytest.mark.timeout(300)


@register("sinks_space_share", description="test reward: share of spaces in the completion")
def sinks_space_share(prompts, completions, **kw):
    return [c.count(" ") / max(len(c), 1) for c in completions]


def tb_scalars(logdir) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} as TensorBoard shows it; a step shown twice is a failure (a resume not purged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        steps = [e.step for e in events]
        assert len(steps) == len(set(steps)), f"{tag}: steps {steps}"
        out[tag] = {e.step: e.value for e in events}
    return out


def jsonl_scalars(path) -> dict[str, dict[int, float]]:
    """{key: {step: value}} of the numbers in metrics.jsonl (null = NaN, ±1e308 = ±inf)."""
    out: dict = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if key == "step" or not (value is None or isinstance(value, (int, float))):
                continue
            value = math.nan if value is None else float(value)
            value = math.copysign(math.inf, value) if abs(value) >= 1e308 else value
            out.setdefault(key, {})[row["step"]] = value
    return out


def assert_same(tb: dict, js: dict) -> None:
    assert set(tb) == set(js), (set(tb) ^ set(js))
    for tag, by_step in js.items():
        assert set(tb[tag]) == set(by_step), tag
        for step, want in by_step.items():
            got = tb[tag][step]
            if math.isnan(want):
                assert math.isnan(got), (tag, step, got)
            else:  # event files hold float32: relative rounding 2^-24
                assert got == pytest.approx(want, rel=1e-6, abs=1e-30), (tag, step)


# ---------------------------------------------------------------- the config key


@pytest.mark.parametrize("recipe", ["sft", "rl", "dpo", "rm", "rs"])
def test_every_recipe_takes_report_to_and_checks_it_at_parse_time(recipe, monkeypatch):
    import importlib

    module = importlib.import_module(f"posttrain.recipes.{recipe}")
    cls = next(getattr(module, n) for n in dir(module) if n.endswith("Config") and n.lower().startswith(recipe))
    assert parse_args(cls, []).report_to == "none"
    assert parse_args(cls, ["report_to= TensorBoard ,tensorboard"]).report_to == "tensorboard"
    with pytest.raises(ConfigError, match="did you mean 'tensorboard'"):
        parse_args(cls, ["report_to=tensorbord"])
    with pytest.raises(ConfigError, match="'none' cannot be combined"):
        parse_args(cls, ["report_to=none,tensorboard"])
    for name, (mod, extra) in SINK_REQUIREMENTS.items():  # each library missing: the error names the extra
        monkeypatch.setitem(sys.modules, mod, None)
        with pytest.raises(ConfigError, match=rf"report_to={name} needs the '{mod}' package.*pip install 'posttrain\[{extra}\]'"):
            parse_args(cls, [f"report_to=tensorboard,{name}" if name != "tensorboard" else "report_to=tensorboard"])
        monkeypatch.delitem(sys.modules, mod)


def test_report_to_takes_a_yaml_list(tmp_path):
    from posttrain.recipes.sft import SFTConfig

    (tmp_path / "c.yaml").write_text("report_to: [tensorboard]\n")
    assert parse_args(SFTConfig, ["--config", str(tmp_path / "c.yaml")]).report_to == "tensorboard"


def test_extras_are_declared_for_every_sink():
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert all(extra in extras for _, extra in SINK_REQUIREMENTS.values())
    assert any(dep.startswith("tensorboard") for dep in extras["dev"])  # so CI runs the TensorBoard tests


def test_mlflow_names_keep_only_the_characters_mlflow_accepts():
    assert mlflow_key("eval/pass@1_low") == "eval/pass_at_1_low"
    assert mlflow_key("time/generate") == "time/generate" and mlflow_key("a(b)") == "a_b_"


# ---------------------------------------------------------------- TensorBoard end to end


def test_sft_scalars_in_tensorboard_match_metrics_jsonl(tmp_path):
    from posttrain.recipes import sft

    cfg = parse_args(sft.SFTConfig, [
        "model=tiny-random", "data=single_digit_add:40", f"output_dir={tmp_path / 'run'}", "max_steps=3", "batch_size=4",
        "max_length=64", "eval_every=2", "sample_every=0", "save_every=0", "progress=false", "forgetting_probe=false",
        "eval_tasks.data=single_digit_add:all", "eval_tasks.max_items=4", "eval_tasks.n=2", "eval_tasks.k=1,2",
        "eval_tasks.sampling={max_new_tokens: 3}", "report_to=tensorboard",
    ])
    sft.train(cfg)
    js = jsonl_scalars(tmp_path / "run" / "metrics.jsonl")
    assert "loss" in js and "eval/pass@1" in js and sorted(js["eval/pass@1"]) == [2, 3]  # the eval hook's rows too
    assert_same(tb_scalars(tmp_path / "run" / "tensorboard"), js)


def test_rl_scalars_in_tensorboard_match_metrics_jsonl_across_a_kill_and_resume(tmp_path, monkeypatch):
    """Killed during step 4 (rows 1–3 logged, checkpoint at 2): the resumed run rewrites steps 3–4, and
    TensorBoard shows the new step 3 (its timings differ from the first try's), once."""
    from posttrain.recipes import rl

    args = ("max_steps=4", "save_every=2", "report_to=tensorboard", "reward=sinks_space_share", "prompts_per_step=2", "group_size=2")
    real_step = rl.rl_step

    def killed(run_, step):
        if step == 3:
            raise KeyboardInterrupt
        return real_step(run_, step)

    monkeypatch.setattr(rl.step, "rl_step", killed)
    with pytest.raises(KeyboardInterrupt):
        run_rl(tmp_path, *args)
    first = jsonl_scalars(tmp_path / "run" / "metrics.jsonl")
    assert sorted(first["reward/mean"]) == [1, 2, 3]
    assert_same(tb_scalars(tmp_path / "run" / "tensorboard"), first)  # flushed at each step: a killed run keeps them
    monkeypatch.setattr(rl.step, "rl_step", real_step)
    run_rl(tmp_path, *args, "resume=true")
    js = jsonl_scalars(tmp_path / "run" / "metrics.jsonl")
    assert sorted(js["reward/mean"]) == [1, 2, 3, 4] and ("kl" in js or "kl_start" in js) and "entropy" in js
    assert js["time/generate"][3] != first["time/generate"][3]  # step 3 ran again
    assert_same(tb_scalars(tmp_path / "run" / "tensorboard"), js)


def test_rs_logs_its_rounds_to_tensorboard(tmp_path):
    from conftest import COUNT_PROMPTS, write_jsonl
    from posttrain.recipes import rs

    data = write_jsonl(tmp_path / "prompts.jsonl", COUNT_PROMPTS[:2])
    rs.train(parse_args(rs.RSConfig, ["model=tiny-random", f"data={data}", f"output_dir={tmp_path / 'run'}",
                                      "reward=sinks_space_share", "n=2", "max_new_tokens=2", "keep_truncated=true",
                                      "sft=false", "progress=false", "report_to=tensorboard"]))
    js = jsonl_scalars(tmp_path / "run" / "metrics.jsonl")
    assert sorted(js["reward/mean"]) == [1]
    assert_same(tb_scalars(tmp_path / "run" / "tensorboard"), js)


def test_a_fresh_run_replaces_the_event_files_of_an_earlier_one(tmp_path):
    cfg = {"model": "tiny-random"}
    for values in ([1.0, 2.0, 3.0], [5.0]):
        writer = MetricsWriter(tmp_path / "metrics.jsonl", sinks=open_sinks("tensorboard", tmp_path, cfg, None))
        for step, v in enumerate(values, 1):
            writer.write(step, {"x": v, "nan": math.nan, "text": "skipped", "vec": [1, 2]})
        writer.close()
    assert tb_scalars(tmp_path / "tensorboard") == {"x": {1: 5.0}, "nan": {1: pytest.approx(math.nan, nan_ok=True)}}


def test_a_failing_sink_is_dropped_with_a_warning_and_the_run_goes_on(tmp_path, capsys):
    class Down:
        def log(self, step, scalars):
            raise ConnectionError("tracker unreachable")

        def close(self):
            raise AssertionError("a dropped sink is not closed")

    writer = MetricsWriter(tmp_path / "metrics.jsonl", sinks=[Down()])
    writer.write(1, {"x": 1.0})
    writer.write(2, {"x": 2.0})
    writer.close()
    assert [json.loads(l)["x"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1.0, 2.0]
    err = capsys.readouterr().err
    assert err.count("Down failed at step 1 (ConnectionError: tracker unreachable)") == 1


# ---------------------------------------------------------------- the other sinks, where installed


def _log_three(tmp_path, name):
    writer = MetricsWriter(tmp_path / "metrics.jsonl", sinks=open_sinks(name, tmp_path, {"model": "m", "optim": {"lr": 0.1}}, None))
    for step in (1, 2, 3):
        writer.write(step, {"reward/mean": step / 4, "eval/pass@1": 0.5})
    writer.close()


def test_mlflow_store_under_the_run_dir(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _log_three(tmp_path, "mlflow")
    client = MlflowClient(tracking_uri=f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}")
    run = client.get_run((tmp_path / "mlflow_run_id").read_text().strip())
    assert run.data.params["optim.lr"] == "0.1" and run.info.status == "FINISHED"
    hist = client.get_metric_history(run.info.run_id, "reward/mean")
    assert sorted((m.step, m.value) for m in hist) == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "eval/pass_at_1")] == [0.5] * 3


def test_wandb_offline_run_under_the_run_dir(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    _log_three(tmp_path, "wandb")
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1
    data = next(runs[0].glob("*.wandb")).read_bytes()  # its records are protobuf, uncompressed (wandb ships no reader)
    assert b"reward/mean" in data and b"eval/pass@1" in data and b"0.75" in data


def test_trackio_local_store(tmp_path, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("trackio") is None or "trackio" in sys.modules:
        pytest.skip("trackio is not installed, or was imported earlier in this process (its store is then fixed)")
    monkeypatch.setenv("TRACKIO_DIR", "")  # recorded, so that the value the sink sets is undone after the test
    monkeypatch.delenv("TRACKIO_DIR")
    _log_three(tmp_path, "trackio")
    from trackio.sqlite_storage import SQLiteStorage

    logs = SQLiteStorage.get_logs("posttrain", tmp_path.name)
    assert [(r["step"], r["reward/mean"], r["eval/pass@1"]) for r in logs] == [(1, 0.25, 0.5), (2, 0.5, 0.5), (3, 0.75, 0.5)]
    assert SQLiteStorage.get_run_config("posttrain", tmp_path.name)["optim"] == {"lr": 0.1}
    assert str(SQLiteStorage.get_project_db_path("posttrain")).startswith(str(tmp_path / "trackio"))


def test_the_names_report_to_accepts_are_the_sinks_there_are():
    from posttrain.monitor.sinks import SINKS

    assert set(SINK_REQUIREMENTS) == set(SINKS)  # the names live in config.py, the classes in monitor/sinks.py


def test_svg_chart_scales_points_into_the_box():
    """The report's per-metric chart: every point inside the plot box, y extremes labelled, NaN skipped."""
    import re

    from posttrain.monitor.report import svg_plot

    svg = svg_plot("loss", [1, 2, 3, 4], [2.0, float("nan"), 1.0, 0.5])
    pts = [tuple(map(float, p.split(","))) for p in re.search(r'points="([^"]+)"', svg).group(1).split()]
    assert len(pts) == 3 and all(46 <= x <= 292 and 20 <= y <= 128 for x, y in pts)
    assert pts[0][1] == 20.0 and pts[-1][1] == 128.0  # max at the top, min at the bottom
    assert ">2</text>" in svg and ">0.5</text>" in svg and svg_plot("flat", [1, 2], [3.0, 3.0]).count("<circle") == 2
