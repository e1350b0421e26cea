"""benchmarks/phases.py: the per-phase table's arithmetic floor row (counted FLOPs at the peak rate)."""

from phases import PhaseClock, as_json, floor, table


def _clock() -> PhaseClock:
    clock = PhaseClock()
    for side, (fwd_s, fwd_flops, opt_s) in {"a": (2.0, 300e9, 0.5), "b": (1.0, 100e9, 0.25)}.items():
        clock.steps[side] = 2
        clock.seconds[side]["forward"] = 2 * fwd_s
        clock.flops[side]["forward"] = 2 * fwd_flops
        clock.seconds[side]["optimizer"] = 2 * opt_s  # no FLOP model: seconds only
    return clock


def test_floor_is_the_counted_flops_per_step_at_peak():
    clock = _clock()
    assert floor(clock, "a", 100e9) == 3.0 and floor(clock, "b", 100e9) == 1.0
    assert as_json(clock, ["a", "b"], 100e9)["floor_s_per_step"] == {"a": 3.0, "b": 1.0}


def test_table_ends_with_the_floor_and_its_share_of_the_step():
    text = table(_clock(), ["a", "b"], 100e9).splitlines()
    total = next(line for line in text if line.startswith("total")).split()
    assert total[1:] == ["2.500", "1.250"]
    row = next(line for line in text if line.startswith("its FLOPs at peak")).split()
    assert row[-4:] == ["3.000", "120%", "1.000", "80%"]  # a counted more than its peak allows: shown, not hidden


def test_table_states_the_ceiling_the_competitors_step_over_our_floor():
    text = table(_clock(), ["a", "b"], 100e9).splitlines()
    ceiling = next(line for line in text if line.startswith("ceiling:"))
    assert "a's step / b's floor = 2.50x" in ceiling  # 2.5 s per step of a over b's 1.0 s floor
    assert not any(line.startswith("ceiling:") for line in table(_clock(), ["a"], 100e9).splitlines())


def test_alternate_runs_one_posttrain_step_after_each_trl_step():
    from phases import Allocator, Trace, alternate

    class Recorder(Trace):  # records the profiler's starts and stops instead of tracing
        def __init__(self):
            super().__init__(None)
            self.events = []

        def start(self, side):
            self.events.append(("start", side))

        def stop(self):
            self.events.append("stop")

    clock, trace, order = PhaseClock(), Recorder(), []
    alt = alternate(clock, trace, Allocator(shared=True), warmup=2,
                    posttrain_step=lambda i: order.append(("pt", i)) or {"i": i}, after_trl=lambda: order.append("trl"))
    alt.on_train_begin(None, None, None)
    for _ in range(3):
        alt.on_step_begin(None, None, None)
        alt.on_step_end(None, None, None)
    assert order == ["trl", ("pt", 0), "trl", ("pt", 1), "trl", ("pt", 2)]
    assert [r["i"] for r in alt.pt_rows] == [0, 1, 2] and len(alt.trl) == len(alt.pt) == 3
    assert clock.steps == {"trl": 1, "posttrain": 1}  # the warm-up steps are not counted
    assert [e for e in trace.events if e != "stop"] == [("start", "trl"), ("start", "posttrain")]  # last warm-up step
