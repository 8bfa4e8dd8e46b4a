"""The monitor's per-report work at the scale of a large job: what every heartbeat and
step report costs must not grow with the number of machines (at 512 machines the
medians recomputed over the whole job for every report took half a core; at 2,048 the
monitor fell behind its heartbeats and declared live machines silent)."""

from __future__ import annotations

import random
import statistics
import time

from trainmover.services.health_monitor.heartbeats import HeartbeatTracker
from trainmover.services.health_monitor.median import SortedMedian
from trainmover.services.health_monitor.plausible import StepBounds
from trainmover.services.health_monitor.stragglers import StragglerDetector

MACHINES = 2048


def test_sorted_median_is_statistics_median_less_one() -> None:
    rng = random.Random(7)
    ordered, plain = SortedMedian(), []
    for _ in range(400):
        if plain and rng.random() < 0.3:
            old = rng.choice(plain)
            plain.remove(old)
            ordered.remove(old)
        else:
            value = float(rng.randint(0, 40))  # repeats: the multiset case
            plain.append(value)
            ordered.add(value)
        assert ordered.median() == (statistics.median(plain) if plain else None)
        for left_out in set(plain):
            rest = list(plain)
            rest.remove(left_out)
            want = statistics.median(rest) if rest else None
            assert ordered.median(excluding=left_out) == want


def _brute_job_median(times: dict[str, list[float]], excluding: str, window: int) -> float:
    return statistics.median(
        statistics.median(t[-window:]) for name, t in times.items() if name != excluding and t
    )


def test_straggler_job_median_unchanged_by_keeping_it_sorted() -> None:
    rng = random.Random(3)
    detector = StragglerDetector(window=5, warmup=2)
    times: dict[str, list[float]] = {f"m{i}": [] for i in range(12)}
    for step in range(30):
        for name in times:
            if step == 20 and name == "m3":
                detector.forget("j", name)
                times[name] = []
                continue
            if len(times) > 1 and any(times[n] for n in times if n != name):
                want = _brute_job_median(times, name, 5)
                assert detector.job_median("j", excluding=name) == want
            compute = rng.uniform(0.1, 0.2)
            detector.observe("j", name, step, compute)
            times[name].append(compute)


def test_step_bounds_reference_is_the_others_median() -> None:
    bounds = StepBounds(max_lead=10)
    for i in range(9):
        assert bounds.check("j", f"m{i}", 100 + i) is None
    # The others' median is 103.5 (m0..m7 at 100..107): 114 is more than 10 ahead.
    assert bounds.check("j", "m8", 114) is not None
    assert bounds.check("j", "m8", 113) is None
    bounds.forget("j", "m8")
    # m0's others are m1..m7 (median 104): 115 is too far ahead, 114 is not.
    assert bounds.check("j", "m0", 115) is not None
    assert bounds.check("j", "m0", 114) is None


def test_a_round_of_reports_of_2048_machines_is_linear() -> None:
    """One step of every machine, and one heartbeat each: O(n) in all. Computed over
    every machine per report these took tens of seconds; the bound leaves a loaded
    runner a wide margin."""
    detector, bounds = StragglerDetector(), StepBounds()
    tracker = HeartbeatTracker(timeout_s=5.0, grace_s=5.0)
    names = [f"m{i}" for i in range(MACHINES)]
    for name in names:
        tracker.watch("j", name, 0.0)
    started = time.process_time()
    for step in range(3):
        for name in names:
            assert bounds.check("j", name, step) is None
            detector.observe("j", name, step, 0.1)
            tracker.beat("j", name, step, 1.0 + step)
            tracker.up_count("j")
    assert time.process_time() - started < 3.0
    assert tracker.up_count("j") == MACHINES
    assert detector.job_median("j", excluding="m0") == 0.1


def test_up_count_follows_lapses_beats_and_unwatches() -> None:
    tracker = HeartbeatTracker(timeout_s=1.0, grace_s=1.0)
    for name in ("a", "b", "c"):
        tracker.watch("j", name, 0.0)
    assert (tracker.up_count("j"), tracker.watched_count("j")) == (3, 3)
    tracker.beat("j", "a", 1, 0.5)
    assert {lapse.machine for lapse in tracker.lapsed(1.2)} == {"b", "c"}
    assert tracker.up_count("j") == 1
    tracker.beat("j", "b", 1, 1.3)
    assert tracker.up_count("j") == 2
    tracker.unwatch("j", "c")  # down when it went
    assert (tracker.up_count("j"), tracker.watched_count("j")) == (2, 2)
    tracker.mark_down("j", "a")
    tracker.unwatch("j", "a")
    assert (tracker.up_count("j"), tracker.watched_count("j")) == (1, 1)
