"""The alarms of offline preference training, on synthetic metric streams."""

import io

from posttrain.monitor.preference_alarms import PreferenceAlarms


def feed(alarms, rows):
    return [alarms.update(step, row) for step, row in enumerate(rows, start=1)]


def test_likelihood_displacement_needs_both_falling_for_patience_steps():
    out = io.StringIO()
    alarms = PreferenceAlarms(patience=3, stream=out)
    both = {"logratio/chosen": -0.2, "logratio/rejected": -3.0}
    healthy = {"logratio/chosen": 0.4, "logratio/rejected": -3.0}
    got = feed(alarms, [both, both, healthy, both, both, both, both])
    assert [g["alarm/likelihood_displacement"] for g in got] == [0, 0, 0, 0, 0, 1, 1]
    assert alarms.fired == {"likelihood_displacement": 6}
    assert out.getvalue().count("ALARM") == 1 and "step 6" in out.getvalue()  # printed once


def test_no_displacement_alarm_without_a_reference():
    alarms = PreferenceAlarms(patience=1)
    assert feed(alarms, [{"logps/chosen": -50.0, "logps/rejected": -60.0}] * 3) == [{}, {}, {}]


def test_length_growth_above_ratio_and_state_round_trip():
    alarms = PreferenceAlarms(max_length_ratio=1.3, stream=io.StringIO())
    got = feed(alarms, [{"length/ratio": 1.0}, {"length/ratio": 1.29}, {"length/ratio": 1.31}, {}])
    assert [g.get("alarm/length_growth") for g in got] == [0, 0, 1, None]
    again = PreferenceAlarms(stream=io.StringIO())
    again.load(alarms.state())
    assert again.fired == {"length_growth": 3}
