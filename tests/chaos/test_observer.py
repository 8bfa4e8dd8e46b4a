"""The soak's reading of a fault's cost from the step statistics (no processes)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, cast

from trainmover.chaos.observer import Observer
from trainmover.chaos.report import FaultRecord, lost_text
from trainmover.messages import StepStats


def _observer(points: list[tuple[float, int, float]]) -> Observer:
    """An observer that has seen one machine's stats: (stamp, step, queued_s)."""
    obs = Observer(cast(Any, SimpleNamespace(job="j")))
    for ts, step, queued in points:
        obs.timeline.append((ts, step))
        obs.queued[step] = queued
    return obs


def test_the_extra_cpu_wait_is_counted_against_the_median_before_the_fault() -> None:
    """Steps 1-10 waited 0.01 s each for a CPU (one outlier of 0.5 s does not move the
    median); steps 11-15, in the fault's window, 0.11 s each: 0.5 s more than normal."""
    before = [(float(s), s, 0.5 if s == 4 else 0.01) for s in range(1, 11)]
    during = [(float(s), s, 0.11) for s in range(11, 16)]
    obs = _observer(before + during)
    assert obs.queued_extra(11, 15) == 0.5
    assert obs.queued_extra(11, 15, window_s=0.5) is None  # nothing seen before it
    assert obs.queued_extra(16, 20) is None  # nothing seen in it


async def test_the_slowest_machine_sets_a_steps_cpu_wait() -> None:
    """From the stats messages: two machines' step 2, the slower one's wait counts."""
    obs = _observer([(time.time() - 1.0, 1, 0.0)])  # stats are stamped when sent
    for machine, queued in (("m0", 0.2), ("m1", 0.05)):
        stats = StepStats(job="j", machine=machine, step=2, compute_s=0.1, queued_s=queued)
        await obs._on_stats(cast(Any, SimpleNamespace(data=stats.to_json())))
    assert obs.steps == {"m0": 2, "m1": 2}
    assert obs.queued_extra(2, 2) == 0.2


def test_the_printed_cost_names_the_hold_and_the_cpu_wait() -> None:
    record = FaultRecord(1, "nats_node_kill", None, "", 0.0, 10)
    assert lost_text(record) == ""
    record.lost_s, record.stall_s, record.queued_extra_s = 0.74, 0.04, 0.61
    assert lost_text(record) == ", lost 0.74s (longest hold 0.04s, +0.61s waiting for a CPU)"
