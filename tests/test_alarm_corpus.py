"""The RL health alarms on recorded runs of SmolLM2-135M-Instruct (tests/fixtures/alarms, recorded by
benchmarks/alarm_corpus.py): honest learning raises nothing; each reward hack is flagged within 5 steps
of when its reward starts to pay."""

import gzip
import json
import statistics
from pathlib import Path

import pytest

from posttrain.monitor.alarms import replay

FIXTURES = Path(__file__).parent / "fixtures" / "alarms"
# what each hack is paid for: the term whose rise marks its onset
HACK_TERM = {"hack_token": "rewards/alarm_corpus.py:magic_word/mean", "hack_length": "rewards/alarm_corpus.py:verbose/mean",
             "hack_format": "reward/mean"}


def load(name: str) -> list[dict]:
    with gzip.open(FIXTURES / f"{name}.jsonl.gz", "rt") as f:
        return [json.loads(line) for line in f]


def verifiers(records: list[dict]) -> dict[str, float]:
    return {"math": 1.0} if "rewards/math/mean" in records[0]["row"] else {}


def onset(records: list[dict], key: str, rise: float = 0.1) -> int:
    """The first step whose `key` is above its mean over the first 3 steps by `rise`."""
    values = [r["row"][key] for r in records]
    base = statistics.fmean(values[:3])
    return next(r["row"]["step"] for r, v in zip(records, values) if v > base + rise)


def honest() -> list[str]:
    return sorted(p.name.split(".")[0] for p in FIXTURES.glob("honest_*.jsonl.gz"))


@pytest.mark.parametrize("name", honest())
def test_honest_runs_raise_nothing(name):
    records = load(name)
    fired = {step: names for step, names in replay(records, verifiers=verifiers(records)).items() if names}
    assert fired == {}, fired


@pytest.mark.parametrize("name", sorted(HACK_TERM))
def test_each_hack_is_flagged_within_5_steps_of_onset(name):
    if not (FIXTURES / f"{name}.jsonl.gz").exists():
        pytest.skip(f"{name}: not recorded")
    records = load(name)
    start = onset(records, HACK_TERM[name])
    fired = [step for step, names in replay(records, verifiers=verifiers(records)).items() if names]
    assert fired, f"{name}: no alarm (onset at step {start})"
    assert fired[0] <= start + 5, f"{name}: first alarm at step {fired[0]}, onset at step {start}"


def test_on_alarm_stop_ends_the_token_hack_with_the_samples_that_carry_it():
    from posttrain.monitor.alarms import AlarmMonitor, AlarmSettings, AlarmStop

    records = load("hack_token")
    monitor = AlarmMonitor(AlarmSettings(on_alarm="stop"), echo=lambda text: None, verifiers={"math": 1.0})
    with pytest.raises(AlarmStop) as stop:
        for r in records:
            monitor.act(monitor.check(r["row"]["step"], r["row"], r["samples"]))
    alarm = stop.value.alarms[0]
    assert alarm.name == "shaping_rise" and alarm.step <= onset(records, HACK_TERM["hack_token"]) + 5
    assert sum("numbers" in s["completion"] for s in alarm.samples) >= 2  # the top samples show the hack
    assert "numbers" in str(stop.value)
