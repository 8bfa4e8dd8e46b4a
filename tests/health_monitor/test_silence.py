"""The gate on failures by silence alone, pure: a host that delays every heartbeat at
once fails at most a fraction of the job; a machine silent on its own is failed."""

from __future__ import annotations

from trainmover.services.health_monitor.heartbeats import Lapse
from trainmover.services.health_monitor.silence import SilenceGate, Verdict


def lapse(machine: str, silent_s: float = 1.6, job: str = "j") -> Lapse:
    return Lapse(job, machine, last_seen=0.0, last_seq=1, last_sent_ts=0.0, silent_s=silent_s)


def machines(verdict: Verdict) -> list[str]:
    return [x.machine for x in verdict.believed]


def test_one_silent_machine_is_believed_at_once() -> None:
    gate = SilenceGate(fraction=0.25, window_s=1.5)
    assert machines(gate.judge([lapse("m2")], 10.0, lambda job: 8)) == ["m2"]
    assert gate.held("j") == []


def test_every_machine_silent_at_once_fails_none() -> None:
    gate = SilenceGate(fraction=0.25, window_s=1.5)
    every = [lapse(f"m{i}", 1.5 + i / 10) for i in range(4)]
    verdict = gate.judge(every, 10.0, lambda job: 4)
    assert verdict.believed == [] and [x.machine for x in verdict.withheld] == [
        "m3", "m2", "m1", "m0"
    ]  # fmt: skip
    assert gate.held("j") == ["m0", "m1", "m2", "m3"]
    # Windows later, still all silent: still a host or bus problem.
    assert gate.judge([], 20.0, lambda job: 4) == Verdict()  # each reported held once
    # Heard again: forgotten, nothing failed.
    assert all(gate.heard("j", f"m{i}") for i in range(4))
    assert machines(gate.judge([], 21.0, lambda job: 4)) == [] and gate.held("j") == []


def test_a_burst_of_lapses_fails_the_limit_per_window_and_the_rest_only_if_still_silent() -> None:
    gate = SilenceGate(fraction=0.25, window_s=1.5)
    watched = lambda job: 12  # noqa: E731 - 12 machines: 3 at once
    first = gate.judge([lapse("m0", 1.7), lapse("m1", 1.6)], 10.0, watched)
    assert machines(first) == ["m0", "m1"]
    # Two more within the window: over the limit with the first two.
    assert machines(gate.judge([lapse("m2"), lapse("m3")], 10.5, watched)) == []
    assert gate.held("j") == ["m2", "m3"]
    assert gate.heard("j", "m3")  # late, then heard again: never failed
    # The window passed and m2 is still silent on its own: believed.
    assert machines(gate.judge([], 11.6, watched)) == ["m2"]
    assert gate.held("j") == []


def test_lapses_of_one_cause_within_a_heartbeat_interval_are_judged_together() -> None:
    gate = SilenceGate(fraction=0.25, window_s=1.5, settle_s=0.5)
    watched = lambda job: 7  # noqa: E731 - 4 machines and 3 standbys
    assert machines(gate.judge([lapse("m0")], 10.0, watched)) == []  # held one interval first
    assert machines(gate.judge([lapse("m1"), lapse("s0"), lapse("m3")], 10.3, watched)) == []
    assert machines(gate.judge([], 10.6, watched)) == []  # 4 of 7 silent: none believed
    assert gate.held("j") == ["m0", "m1", "m3", "s0"]
    for machine in ("m1", "s0", "m3"):
        gate.heard("j", machine)
    # m0 alone stays silent: believed once silent a whole window after the mass ended.
    assert machines(gate.judge([], 10.7, watched)) == []
    assert machines(gate.judge([], 12.2, watched)) == ["m0"]


def test_the_last_machine_heard_after_a_mass_silence_is_not_failed() -> None:
    gate = SilenceGate(fraction=0.25, window_s=10.0, settle_s=0.2)
    watched = lambda job: 7  # noqa: E731 - 4 machines and 3 standbys
    everyone = ["m0", "m1", "m2", "m3", "s0", "s1", "s2"]
    assert gate.judge([lapse(m, 10.0) for m in everyone], 20.0, watched).believed == []
    assert machines(gate.judge([], 20.3, watched)) == []  # settled, and all held
    # The host comes back: the machines are heard one by one, m3 last.
    for machine in everyone:
        if machine != "m3":
            gate.heard("j", machine)
    assert machines(gate.judge([], 20.35, watched)) == []  # m3 silent since the mass only
    assert gate.heard("j", "m3")  # heard too: nothing failed
    assert machines(gate.judge([], 30.5, watched)) == [] and gate.held("j") == []


def test_jobs_are_judged_apart_and_a_heard_machine_that_was_not_held_is_no_news() -> None:
    gate = SilenceGate(fraction=0.5, window_s=1.5)
    assert machines(gate.judge([lapse("m0", job="a"), lapse("m0", job="b")], 1.0, lambda j: 4)) == [
        "m0",
        "m0",
    ]
    assert not gate.heard("a", "m0")
    assert gate.limit(4) == 2 and gate.limit(1) == 1
