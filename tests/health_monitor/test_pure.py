"""Unit tests of the health-monitor's pure logic: no processes, no clocks, no bus."""

from __future__ import annotations

import pytest

from tests.conftest import sample_state
from trainmover.messages import ClusterState, Heartbeat, MachineState, Plan, WorkerStatus
from trainmover.services.health_monitor.alertmanager import PayloadError, parse_payload
from trainmover.services.health_monitor.dedup import (
    Incident,
    IncidentTable,
    SeenWindow,
    TokenBucket,
)
from trainmover.services.health_monitor.events import event_id
from trainmover.services.health_monitor.heartbeats import HeartbeatTracker, abnormal_exits
from trainmover.services.health_monitor.reexamine import reason_to_ask_again
from trainmover.services.health_monitor.roster import Roster
from trainmover.services.health_monitor.rules import (
    RuleSet,
    Unmapped,
    load_rules,
    parse_deadline,
    strip_port,
)
from trainmover.services.health_monitor.stragglers import StragglerDetector
from trainmover.services.health_monitor.webhook import parse_time
from trainmover.services.planner.plans import free_standby

from .payloads import RULES_FILE, alert, payload

# --- heartbeats -------------------------------------------------------------------------


def test_lapse_reported_once_then_recovery_rearms() -> None:
    t = HeartbeatTracker(timeout_s=1.5, grace_s=1.5)
    t.watch("j", "m0", now=0.0)
    t.beat("j", "m0", seq=1, now=1.0)
    assert t.lapsed(2.4) == []
    lapses = t.lapsed(2.6)
    assert [(x.machine, x.last_seq) for x in lapses] == [("m0", 1)]
    assert t.lapsed(10.0) == []  # still silent: not reported again
    assert t.up_count("j") == 0
    assert t.beat("j", "m0", seq=2, now=11.0) is True  # back
    assert [x.machine for x in t.lapsed(12.6)] == ["m0"]  # a new silence is a new lapse


def test_grace_for_a_newly_watched_machine() -> None:
    t = HeartbeatTracker(timeout_s=1.0, grace_s=5.0)
    t.watch("j", "m0", now=100.0)
    assert t.lapsed(104.9) == []
    (lapse,) = t.lapsed(105.0)
    assert lapse.last_seen is None and lapse.silent_s == pytest.approx(5.0)


def test_a_machine_heard_before_its_watch_is_judged_by_the_timeout() -> None:
    # A standby heartbeats before it is in the cluster state; it is admitted, picked as
    # a joiner and killed at once: its silence counts from its last heartbeat.
    t = HeartbeatTracker(timeout_s=1.0, grace_s=60.0)
    assert t.beat("j", "s0", seq=7, now=10.0, sent_ts=1234.5) is False  # not watched
    t.watch("j", "s0", now=10.5)
    assert t.due_in("j", "s0", 10.5) == pytest.approx(0.5)
    (lapse,) = t.lapsed(11.0)
    assert (lapse.last_seen, lapse.last_seq, lapse.last_sent_ts) == (10.0, 7, 1234.5)
    assert lapse.silent_s == pytest.approx(1.0)


def test_a_heartbeat_older_than_the_timeout_leaves_the_grace() -> None:
    t = HeartbeatTracker(timeout_s=1.0, grace_s=5.0)
    t.beat("j", "m0", seq=1, now=0.0)
    t.watch("j", "m0", now=2.0)  # heard too long ago to say anything about it now
    assert t.lapsed(6.9) == []
    (lapse,) = t.lapsed(7.0)
    assert lapse.last_seen is None


def test_heartbeats_of_unwatched_machines_are_remembered_within_a_bound() -> None:
    from trainmover.services.health_monitor.heartbeats import HEARD_MAX

    t = HeartbeatTracker(timeout_s=1.0, grace_s=5.0)
    for i in range(HEARD_MAX + 10):
        t.beat("j", f"x{i}", seq=1, now=0.0)
    assert len(t._heard) == HEARD_MAX
    t.watch("j", "x0", now=0.5)  # the oldest was forgotten: the grace applies
    assert t.due_in("j", "x0", 0.5) == pytest.approx(5.0)
    t.watch("j", f"x{HEARD_MAX + 9}", now=0.5)
    assert t.due_in("j", f"x{HEARD_MAX + 9}", 0.5) == pytest.approx(0.5)


def test_rebase_forgives_the_silence_the_monitor_could_not_hear() -> None:
    t = HeartbeatTracker(timeout_s=1.0, grace_s=5.0)
    for machine in ("m0", "m1", "m2"):
        t.watch("j", machine, now=0.0)
    t.beat("j", "m0", seq=1, now=1.0)
    t.beat("j", "m2", seq=1, now=0.5)
    assert [x.machine for x in t.lapsed(1.6)] == ["m2"]  # heard going silent: down
    # The monitor is off the bus from 1.7 to 10 (it checks nothing meanwhile).
    t.rebase(10.0)
    assert t.lapsed(10.9) == []  # m0 gets a whole timeout from the reconnect
    assert t.beat("j", "m0", seq=2, now=10.5) is False  # it never was down
    assert [x.machine for x in t.lapsed(14.9)] == ["m0"]  # a silence after the reconnect
    assert [x.machine for x in t.lapsed(15.0)] == ["m1"]  # never heard: the grace again
    assert t.lapsed(100.0) == []  # m2 was down before: reported once, not again


def test_unwatched_machine_never_lapses() -> None:
    t = HeartbeatTracker(timeout_s=1.0, grace_s=1.0)
    t.watch("j", "m0", now=0.0)
    t.unwatch("j", "m0")
    assert t.lapsed(100.0) == []
    assert t.beat("j", "m0", 1, 100.0) is False


def test_heap_stays_bounded_under_many_heartbeats() -> None:
    t = HeartbeatTracker(timeout_s=1.0, grace_s=1.0)
    for m in range(10):
        t.watch("j", f"m{m}", 0.0)
    for i in range(10_000):
        t.beat("j", f"m{i % 10}", i, i * 0.01)
    assert len(t._heap) <= 4 * 10 + 64


def test_abnormal_exits() -> None:
    hb = Heartbeat(
        job="j",
        machine="m0",
        seq=3,
        status="active",
        workers=[
            WorkerStatus(local_rank=0, state="running"),
            WorkerStatus(local_rank=1, state="exited", exit_code=0),
            WorkerStatus(local_rank=2, state="exited", exit_code=-9),
            WorkerStatus(local_rank=3, state="exited", exit_code=None),
        ],
    )
    assert [w.local_rank for w in abnormal_exits(hb)] == [2, 3]


# --- stragglers -------------------------------------------------------------------------


def _feed(d: StragglerDetector, step: int, times: dict[str, float]) -> list[str]:
    found = []
    for machine, t in times.items():
        f = d.observe("j", machine, step, t)
        if f:
            found.append(f.machine)
    return found


def test_one_slow_step_is_not_a_straggler() -> None:
    d = StragglerDetector(factor=1.5, consecutive=3, window=10)
    found = []
    for step in range(20):
        slow = 0.3 if step == 10 else 0.1
        found += _feed(d, step, {"m0": 0.1, "m1": 0.1, "m2": slow, "m3": 0.1})
    assert found == []


def test_sustained_slowness_flags_once_with_evidence() -> None:
    d = StragglerDetector(factor=1.5, consecutive=3, window=10, warmup=5)
    for step in range(5):
        assert _feed(d, step, {"m0": 0.1, "m1": 0.1, "m2": 0.1}) == []
    findings = []
    for step in range(5, 30):
        for machine, t in {"m0": 0.1, "m1": 0.1, "m2": 0.25}.items():
            f = d.observe("j", machine, step, t)
            if f:
                findings.append(f)
    assert len(findings) == 1
    (f,) = findings
    assert f.machine == "m2" and f.first_slow_step == 5 and f.step == 7
    assert f.evidence.machine_median_s == pytest.approx(0.25)
    assert f.evidence.job_median_s == pytest.approx(0.1)
    assert f.evidence.window == 3 and f.evidence.factor == 1.5


def test_a_machines_first_steps_are_not_judged() -> None:
    # Everyone's first steps are slow and uneven (lazy initialisation on a busy host).
    d = StragglerDetector(factor=1.5, consecutive=2, window=10, warmup=4)
    found = []
    for step in range(4):
        found += _feed(d, step, {"m0": 0.1, "m1": 0.1, "m2": 2.0})
    assert found == []
    for step in range(4, 8):  # still slow once judged: a straggler after all
        found += _feed(d, step, {"m0": 0.1, "m1": 0.1, "m2": 2.0})
    assert found == ["m2"]


def test_hysteresis_clears_after_normal_steps_then_can_flag_again() -> None:
    d = StragglerDetector(factor=1.5, consecutive=2, window=3)
    pattern = [0.1] * 3 + [0.3] * 4 + [0.1] * 1 + [0.3] * 2 + [0.1] * 5 + [0.3] * 2
    flagged_at = []
    for step, t in enumerate(pattern):
        _feed(d, step, {"m0": 0.1, "m1": 0.1})
        if d.observe("j", "m2", step, t):
            flagged_at.append(step)
    # One normal step between two slow runs does not clear the flag; five do.
    assert flagged_at == [4, 16]


def test_repeated_step_reports_are_ignored() -> None:
    d = StragglerDetector(factor=1.5, consecutive=2, window=3)
    _feed(d, 0, {"m0": 0.1, "m1": 0.1})
    assert d.observe("j", "m1", 1, 1.0) is None
    assert d.observe("j", "m1", 1, 1.0) is None  # same step again: not a second slow step
    assert d.observe("j", "m1", 0, 1.0) is None


def test_evidence_of_a_flagged_machine_is_its_recent_steps_against_the_job() -> None:
    d = StragglerDetector(factor=1.5, consecutive=2, window=4, warmup=2)
    for step in range(2):
        _feed(d, step, {"m0": 0.1, "m1": 0.1, "m2": 0.1})
    assert d.evidence("j", "m2") is None  # not flagged
    for step in range(2, 6):
        _feed(d, step, {"m0": 0.1, "m1": 0.1, "m2": 0.4})
    evidence = d.evidence("j", "m2")
    assert evidence is not None and d.is_flagged("j", "m2")
    assert evidence.machine_median_s == pytest.approx(0.4)
    assert evidence.job_median_s == pytest.approx(0.1)
    assert evidence.window == 2


# --- re-examining a rejected straggler ----------------------------------------------------

NOW = 1000.0


def _rejected_state(standby_warm: list[str] | None = None, **changes: object) -> ClusterState:
    """m3 (last stage) was reported as a straggler in event "e1" and turned down."""
    state = sample_state("j", standbys=1)
    machines = dict(state.machines)
    machines["s0"] = MachineState(status="joining")  # taken by another migration
    if standby_warm is not None:
        machines["s0"] = MachineState(status="standby", warm_role_types=standby_warm)
    update = {"machines": machines, "handled": {"e1": "rejected"}, **changes}
    return state.model_copy(update=update)


LAST = Incident("j", "m3", "straggler", "e1", "straggler_detector", opened_ts=NOW - 60)


def test_a_rejected_straggler_is_asked_again_once_a_warm_standby_is_free() -> None:
    assert reason_to_ask_again(_rejected_state(), "m3", LAST, NOW, 30) is None
    why = reason_to_ask_again(_rejected_state(["first", "last"]), "m3", LAST, NOW, 30)
    assert why is not None and "standby s0 is free" in why and "e1 was rejected" in why


@pytest.mark.parametrize(
    ("state", "last", "what"),
    [
        (_rejected_state(["first"]), LAST, "a standby warm for another role type only"),
        (_rejected_state(["last"], handled={}), LAST, "the planner has not decided yet"),
        (_rejected_state(["last"], handled={"e1": "p-123"}), LAST, "it became a plan"),
        (_rejected_state(["last"], cooldown_until={"m3": NOW + 5}), LAST, "cool-down"),
        (
            _rejected_state(["last"]),
            Incident("j", "m3", "straggler", "e1", "straggler_detector", opened_ts=NOW - 10),
            "asked 10 s ago, the interval is 30 s",
        ),
    ],
)
def test_a_rejected_straggler_is_not_asked_again(
    state: ClusterState, last: Incident, what: str
) -> None:
    assert reason_to_ask_again(state, "m3", last, NOW, 30) is None, what


def test_nothing_is_asked_while_a_migration_is_in_flight_or_of_a_machine_leaving() -> None:
    plan = Plan(
        job="j", plan_id="p1", event_id="e0", migration="planned", moves=[], groups=[], transfers=[]
    )
    busy = _rejected_state(["last"], in_flight={"p1": plan})
    assert reason_to_ask_again(busy, "m3", LAST, NOW, 30) is None
    free = _rejected_state(["last"])
    leaving = {**free.machines, "m3": MachineState(status="leaving", cell=free.machines["m3"].cell)}
    state = free.model_copy(update={"machines": leaving})
    assert reason_to_ask_again(state, "m3", LAST, NOW, 30) is None


def test_a_flagged_machine_without_an_open_incident_is_asked_when_a_standby_is_free() -> None:
    # Its incident aged out of the dedup window while it stayed slow.
    why = reason_to_ask_again(_rejected_state(["last"]), "m3", None, NOW, 30)
    assert why is not None and "no open incident" in why
    assert free_standby(_rejected_state(["first", "last"]), "m0") == "s0"
    assert free_standby(_rejected_state(), "m0") is None


# --- dedup --------------------------------------------------------------------------------


def test_incident_table_window_and_close() -> None:
    table = IncidentTable(window_s=60)
    inc = Incident("j", "m0", "failure", "e1", "heartbeat", opened_ts=100.0)
    table.open(inc)
    assert table.active(("j", "m0", "failure"), 159.0) == inc
    assert table.active(("j", "m0", "drain"), 110.0) is None
    assert table.active(("j", "m0", "failure"), 160.0) is None  # aged out
    table.open(inc)
    table.open(Incident("j", "m0", "drain", "e2", "alertmanager", 100.0))
    assert len(table.close_machine("j", "m0")) == 2 and len(table) == 0


def test_incident_table_is_bounded() -> None:
    table = IncidentTable(window_s=60, max_entries=3)
    for i in range(10):
        table.open(Incident("j", f"m{i}", "failure", f"e{i}", "heartbeat", 0.0))
    assert len(table) == 3


def test_seen_window_and_token_bucket() -> None:
    seen: SeenWindow[str] = SeenWindow(window_s=10, max_entries=2)
    assert seen.first("a", 0) and not seen.first("a", 5) and seen.first("a", 11)
    for key in "bcdef":
        seen.first(key, 12)
    assert len(seen) == 2
    bucket = TokenBucket(rate=1, burst=2, now=0)
    assert [bucket.allow(0) for _ in range(3)] == [True, True, False]
    assert bucket.allow(1.0)


def test_event_ids_are_deterministic() -> None:
    a = event_id("j", "m0", "failure", "alert:abc:2024")
    assert a == event_id("j", "m0", "failure", "alert:abc:2024")
    assert a != event_id("j", "m0", "drain", "alert:abc:2024")
    assert len(a) <= 128


# --- roster -------------------------------------------------------------------------------


def test_roster_changes() -> None:
    state = sample_state("j", machines=2, standbys=1)
    roster = Roster(["j"])
    first = roster.update(state)
    assert sorted(first.started) == ["m0", "m1", "s0"] and first.settled == []
    machines = dict(state.machines)
    machines["m1"] = MachineState(status="failed")
    del machines["s0"]
    second = roster.update(state.model_copy(update={"machines": machines, "revision": 2}))
    assert second.started == [] and sorted(second.settled) == ["m1", "s0"]
    assert roster.is_watched("j", "m0") and not roster.is_watched("j", "m1")
    old = roster.update(state.model_copy(update={"revision": 1}))
    assert old.status_changed == []  # an older revision is ignored


# --- alert payloads and rules ------------------------------------------------------------


def test_parse_documented_payload() -> None:
    body = payload([alert("GPUXidError", node="m1")])
    parsed = parse_payload(body)
    assert parsed.version == "4" and parsed.alerts[0].labels["node"] == "m1"


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{not json", "malformed JSON"),
        (b"", "empty body"),
        (b'{"version": "4", "status": "firing"}', "field 'alerts'"),
        (b'{"version": "3", "status": "firing", "alerts": []}', "unsupported webhook payload"),
        (
            b'{"version": "4", "status": "firing", "alerts": [{"status": "x", "labels": {}}]}',
            "field 'alerts.0.status'",
        ),
        (
            b'{"version": "4", "status": "firing", "alerts": [],'
            b' "commonAnnotations": {"a\\nb": 1}}',
            r"field 'commonAnnotations.a\\nb'",
        ),
    ],
)
def test_malformed_payloads(body: bytes, reason: str) -> None:
    with pytest.raises(PayloadError, match=reason) as err:
        parse_payload(body)
    assert "\n" not in str(err.value)


def test_rules_file_maps_alerts() -> None:
    rules = load_rules(RULES_FILE)
    a = parse_payload(payload([alert("GPUXidError", instance="gpu-07.dc1.example.com:9100")]))
    m = rules.map(a.alerts[0], now=0)
    assert (m.kind, m.machine, m.job, m.deadline_s) == ("failure", "gpu-07", None, None)
    drain = parse_payload(
        payload([alert("NodePlannedMaintenance", node="m2", drain_deadline="10m")])
    ).alerts[0]
    assert rules.map(drain, now=0).deadline_s == 600
    default = parse_payload(payload([alert("NodePlannedMaintenance", node="m2")])).alerts[0]
    assert rules.map(default, now=0).deadline_s == 3600
    with pytest.raises(Unmapped, match="no rule maps alertname 'DiskFull'"):
        rules.map(parse_payload(payload([alert("DiskFull", node="m1")])).alerts[0], 0)
    # NodeDown needs severity=critical
    warn = parse_payload(payload([alert("NodeDown", node="m1", severity="warning")])).alerts[0]
    with pytest.raises(Unmapped):
        rules.map(warn, 0)
    nolabel = parse_payload(payload([alert("GPUXidError", pod="x")])).alerts[0]
    with pytest.raises(Unmapped) as err:
        rules.map(nolabel, 0)
    assert err.value.category == "no_machine"


def test_rules_from_toml(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "rules.toml"
    path.write_text('machine_labels = ["host"]\n[[rules]]\nalertname = "X"\nevent = "drain"\n')
    rules = load_rules(path)
    assert isinstance(rules, RuleSet) and rules.rules[0].event == "drain"


def test_strip_port_and_deadlines() -> None:
    assert strip_port("gpu-07:9100") == "gpu-07"
    assert strip_port("[fe80::1]:9100") == "fe80::1"
    assert strip_port("gpu-07") == "gpu-07"
    assert parse_deadline("600", 0) == 600
    assert parse_deadline("1h30m", 0) == 5400
    assert parse_deadline("90s", 0) == 90
    assert parse_deadline("2024-01-01T00:10:00Z", 1704067200.0) == 600
    assert parse_deadline("soon", 0) is None
    assert parse_time("2024-01-01T00:00:00.123456789Z") == pytest.approx(1704067200.123456)
    assert parse_time("0001-01-01T00:00:00Z") is None
