"""runner/step_overhead.py: what a step with a prompt chunk costs beyond the graph replay it
displaces, from timed pairs of steps. The steps and the clock are fakes: nothing here times
anything real."""

import pytest

from ponytail.runner.step_overhead import StepOverhead, measure_step_overhead


class FakeDevice:
    """Each step advances the clock by its cost; sync() records that the device went idle."""

    def __init__(self, eager_s, replay_s):
        self.now, self.calls = 0.0, []
        self.eager_s, self.replay_s = eager_s, replay_s

    def clock(self) -> float:
        return self.now

    def eager(self, rows: int) -> None:
        self.calls.append(("eager", rows))
        self.now += self.eager_s(rows)

    def replay(self, rows: int) -> None:
        self.calls.append(("replay", rows))
        self.now += self.replay_s(rows)


def test_the_overhead_is_the_eager_step_less_the_replay_at_each_row_count():
    # A host-bound small model: the eager step costs 10 ms at any size, a replay 2 ms + 0.1 ms per row.
    device = FakeDevice(lambda n: 0.010, lambda n: 0.002 + 0.0001 * n)
    overhead = measure_step_overhead(device.eager, device.replay, rows=(64, 1), sync=lambda: None,
                                     clock=device.clock, repeats=3)
    assert overhead.rows == (1, 64)
    assert overhead.seconds == pytest.approx((0.0079, 0.0016))
    # one untimed pair per row count first (lazy inits, compiles), then the timed pairs
    assert device.calls[:2] == [("eager", 1), ("replay", 1)] and len(device.calls) == 2 * (1 + 3) * 2


def test_a_step_no_dearer_than_its_replay_has_no_overhead():
    device = FakeDevice(lambda n: 0.013, lambda n: 0.014)  # a 7B: the device's work is the same either way
    overhead = measure_step_overhead(device.eager, device.replay, rows=(1, 8), sync=lambda: None,
                                     clock=device.clock, repeats=2)
    assert overhead.seconds == (0.0, 0.0)


def test_the_median_pair_is_kept():
    eager_costs = iter([0.010, 0.012, 0.090, 0.011])  # the untimed step, then three timed: one slow
    device = FakeDevice(lambda n: next(eager_costs), lambda n: 0.002)
    overhead = measure_step_overhead(device.eager, device.replay, rows=(1,), sync=lambda: None,
                                     clock=device.clock, repeats=3)
    assert overhead.seconds == pytest.approx((0.010,))  # the median of 10, 88 and 9 ms


def test_at_interpolates_between_the_measured_rows_and_holds_outside_them():
    overhead = StepOverhead(rows=(1, 64), seconds=(0.008, 0.002))
    assert overhead.at(0) == overhead.at(1) == 0.008
    assert overhead.at(64) == overhead.at(500) == 0.002
    assert overhead.at(22) == pytest.approx(0.008 - 0.006 * 21 / 63)
    three = StepOverhead(rows=(1, 8, 64), seconds=(0.004, 0.006, 0.0))
    assert three.at(4) == pytest.approx(0.004 + 0.002 * 3 / 7)
    assert three.at(36) == pytest.approx(0.003)
    assert overhead.describe() == "8.00 ms at 1 decode rows, 2.00 ms at 64 decode rows"
