"""Message contracts: round-trips and each class of rejected input (pure, no bus)."""

from __future__ import annotations

import json

import pytest

from trainmover.messages import (
    SCHEMA_VERSION,
    Command,
    CommandReply,
    DrainEvent,
    FailureEvent,
    Heartbeat,
    MessageError,
    MigrationProgress,
    Plan,
    RebalanceEvent,
    StepStats,
    StragglerEvent,
    StragglerEvidence,
    WorkerStatus,
    decode,
    decode_event,
)
from trainmover.runtime.layout import Layout
from trainmover.runtime.plan import compute_delta
from trainmover.subjects import InvalidName, JobSubjects

LAYOUT = Layout(tp=2, pp=2, dp=2)

EXAMPLES = [
    DrainEvent(job="j1", machine="m0", reason="driver update", deadline_s=600),
    FailureEvent(job="j1", machine="m1", reason="gpu xid 79", source="alertmanager", exit_code=-9),
    StragglerEvent(
        job="j1",
        machine="m2",
        evidence=StragglerEvidence(machine_median_s=0.4, job_median_s=0.2, factor=1.5, window=20),
    ),
    RebalanceEvent(job="j1"),
    Heartbeat(
        job="j1",
        machine="m0",
        seq=3,
        status="active",
        workers=[WorkerStatus(local_rank=0, pid=123, state="running", step=7)],
    ),
    StepStats(job="j1", machine="m0", step=7, compute_s=0.05),
    Plan(
        **dict(
            compute_delta(
                job="j1",
                plan_id="p1",
                layout=LAYOUT,
                assignment=dict(zip(["m0", "m1", "m2", "m3"], LAYOUT.cells(), strict=True)),
                generations=dict.fromkeys(LAYOUT.all_groups(), 0),
                moves={"m0": "s0"},
            )
        ),
        event_id="e1",
        migration="planned",
        switch_step=12,
        state_sources={"m0": "m0"},
    ),
    Command(job="j1", machine="s0", op="prepare", plan_id="p1", args={"step": 3}),
    CommandReply(command_id="c1", ok=True, result={"ready": True}),
    MigrationProgress(
        job="j1", event_id="e1", plan_id="p1", state="done", downtime_s=0.4, phases={"commit": 0.01}
    ),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message):
    raw = message.to_json()
    assert decode(type(message), raw) == message
    assert json.loads(raw)["schema_version"] == SCHEMA_VERSION


@pytest.mark.parametrize("message", EXAMPLES[:4], ids=lambda m: type(m).__name__)
def test_event_dispatch_on_kind(message):
    assert decode_event(message.to_json()) == message


def _drain(**overrides):
    body = {"kind": "drain", "job": "j1", "machine": "m0", "schema_version": SCHEMA_VERSION}
    body.update(overrides)
    return json.dumps({k: v for k, v in body.items() if v is not ...})


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("{not json", "malformed JSON"),
        ("[1, 2]", "object"),
        (_drain(kind="reboot"), "field 'kind': unknown kind 'reboot'"),
        (_drain(kind=...), "field 'kind': missing"),
        (_drain(machine=...), "field 'machine': Field required"),
        (_drain(schema_version=2), "field 'schema_version': unsupported schema_version 2"),
        (_drain(schema_version="1"), "field 'schema_version'"),
        (_drain(deadline_s="soon"), "field 'deadline_s'"),
        (_drain(deadline_s=-5), "field 'deadline_s'"),
        (_drain(machine="m0.>"), "field 'machine'"),
        (_drain(surprise=1), "field 'surprise': Extra inputs are not permitted"),
    ],
    ids=[
        "malformed",
        "not-object",
        "unknown-kind",
        "no-kind",
        "missing-field",
        "wrong-version",
        "version-as-string",
        "wrong-type",
        "out-of-range",
        "wildcard-name",
        "extra-field",
    ],
)
def test_rejections_name_the_field(raw, reason):
    with pytest.raises(MessageError) as err:
        decode_event(raw)
    assert reason in str(err.value)
    assert "\n" not in str(err.value)


def test_nested_errors_name_the_path():
    bad = json.loads(EXAMPLES[6].to_json())
    bad["moves"][0]["roles"][0]["tp"] = -1
    with pytest.raises(MessageError, match=r"field 'moves\.0\.roles\.0\.tp'"):
        decode(Plan, json.dumps(bad))


def test_a_plan_whose_state_sources_disagree_with_its_moves_is_refused():
    plan = json.loads(EXAMPLES[6].to_json())
    assert plan["state_sources"] == {"m0": "m0"}  # the leaver sends its own state
    plan["state_sources"] = {"m0": "m2"}
    with pytest.raises(MessageError, match="disagree with the sources of the plan's moves"):
        decode(Plan, json.dumps(plan))


def test_subjects_are_namespaced_by_job():
    a, b = JobSubjects("a"), JobSubjects("b")
    assert a.event("drain") == "tm.a.events.drain"
    assert a.command("m1") == "tm.a.cmd.m1"
    assert set(a.streams).isdisjoint(b.streams)
    assert a.bucket != b.bucket
    with pytest.raises(InvalidName):
        JobSubjects("a.b")
    with pytest.raises(InvalidName):
        a.heartbeat("*")
