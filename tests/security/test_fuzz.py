"""Hostile input never crashes a decoder: property tests (hypothesis) and a bounded fuzz
run over every decoder -- the message models, interruption events, the Alertmanager
webhook body and its rules, and commands to a sidecar over the real bus.

Every decoder raises only its documented error (MessageError, PayloadError, Unmapped)
and anything it accepts survives a round trip unchanged, so no input corrupts state."""

from __future__ import annotations

import json
import random
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from tests.conftest import sample_state
from tests.health_monitor.payloads import RULES_FILE, alert, payload
from trainmover import bus
from trainmover.messages import (
    ALL_MESSAGES,
    MAX_MESSAGE_BYTES,
    CollectiveErrorReport,
    Command,
    CommandReply,
    DeadLetter,
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
from trainmover.services.health_monitor.alertmanager import PayloadError, parse_payload
from trainmover.services.health_monitor.rules import Unmapped, load_rules
from trainmover.services.health_monitor.webhook import parse_time
from trainmover.subjects import JobSubjects

MODELS: list[type[BaseModel]] = [m for m in ALL_MESSAGES.values() if isinstance(m, type)]
PROPERTY = settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)
FUZZ = settings(
    max_examples=2000, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6)
    ),
    max_leaves=30,
)


def samples() -> list[Any]:
    """One valid instance of every message a service decodes."""
    evidence = StragglerEvidence(machine_median_s=2.0, job_median_s=1.0, factor=1.5, window=5)
    plan = Plan.model_validate(
        {
            "job": "j",
            "plan_id": "p",
            "event_id": "e",
            "migration": "planned",
            "moves": [],
            "groups": [],
            "transfers": [],
        }
    )
    return [
        DrainEvent(job="j", machine="m0", deadline_s=60, reason="driver"),
        FailureEvent(job="j", machine="m1", exit_code=137),
        StragglerEvent(job="j", machine="m2", evidence=evidence),
        RebalanceEvent(job="j"),
        Heartbeat(
            job="j",
            machine="m0",
            seq=3,
            status="active",
            workers=[WorkerStatus(local_rank=0, pid=12, state="running", step=4)],
        ),
        StepStats(job="j", machine="m0", step=1, compute_s=0.05),
        CollectiveErrorReport(job="j", machine="m0", peer="m1", group="tp0", error="closed"),
        Command(job="j", machine="m0", op="commit", args={"step": 10}),
        CommandReply(command_id="c", ok=True, result={"a": [1, 2]}),
        MigrationProgress(job="j", event_id="e", state="phase1", phases={"phase1": 0.2}),
        DeadLetter(job="j", subject="s", reason="r", payload="x", service="t"),
        plan,
        sample_state("j"),
    ]


SAMPLES = samples()


def mutate(value: Any, rng: random.Random, json_value: Any) -> Any:
    """`value` with one random change somewhere inside: a field dropped, replaced by
    `json_value`, added, or its type changed."""
    if isinstance(value, dict) and value and rng.random() < 0.7:
        key = rng.choice(sorted(value))
        out = dict(value)
        action = rng.randrange(4)
        if action == 0:
            del out[key]
        elif action == 1:
            out[key] = json_value
        elif action == 2:
            out[key + "_x"] = json_value
        else:
            out[key] = mutate(value[key], rng, json_value)
        return out
    if isinstance(value, list) and value and rng.random() < 0.7:
        i = rng.randrange(len(value))
        return [*value[:i], mutate(value[i], rng, json_value), *value[i + 1 :]]
    return json_value


def check_decoder(model: type[BaseModel], raw: bytes | str) -> None:
    """Decoding raises MessageError or gives a message that round-trips unchanged."""
    try:
        message = decode(model, raw)  # type: ignore[type-var]
    except MessageError as err:
        assert str(err) and "\n" not in str(err)
        return
    assert decode(model, message.model_dump_json()) == message  # type: ignore[type-var]


def check_event_decoder(raw: bytes | str) -> None:
    try:
        event = decode_event(raw)
    except MessageError as err:
        assert str(err) and "\n" not in str(err)
        return
    assert decode_event(event.model_dump_json()) == event


# --- properties ----------------------------------------------------------------------


@PROPERTY
@given(st.sampled_from(MODELS), st.binary(max_size=4096))
def test_arbitrary_bytes_never_crash_a_decoder(model: type[BaseModel], raw: bytes) -> None:
    check_decoder(model, raw)
    check_event_decoder(raw)


@PROPERTY
@given(st.sampled_from(MODELS), json_values)
def test_arbitrary_json_never_crashes_a_decoder(model: type[BaseModel], value: Any) -> None:
    raw = json.dumps(value)
    check_decoder(model, raw)
    check_event_decoder(raw.encode())


@PROPERTY
@given(st.sampled_from(SAMPLES), st.randoms(use_true_random=False), json_values)
def test_mutated_messages_are_rejected_or_intact(
    sample: Any, rng: random.Random, value: Any
) -> None:
    data = mutate(json.loads(sample.model_dump_json()), rng, value)
    raw = json.dumps(data)
    check_decoder(type(sample), raw)
    if isinstance(sample, (DrainEvent, FailureEvent, StragglerEvent, RebalanceEvent)):
        check_event_decoder(raw)


def test_oversized_input_is_refused_before_parsing() -> None:
    huge = b'{"kind": "drain", "reason": "' + b"x" * MAX_MESSAGE_BYTES + b'"}'
    for decoder in (lambda raw: decode(DrainEvent, raw), decode_event):
        try:
            decoder(huge)
        except MessageError as err:
            assert "exceeds the limit" in str(err)
        else:
            raise AssertionError("an oversized message was accepted")


def test_non_finite_numbers_are_rejected() -> None:
    for text in (
        '{"job": "j", "machine": "m", "deadline_s": Infinity}',
        '{"job": "j", "machine": "m", "ts": NaN}',
    ):
        try:
            decode(DrainEvent, text)
        except MessageError:
            continue
        raise AssertionError(f"accepted {text}")


RULES = load_rules(RULES_FILE)
VALID_BODY = json.loads(payload([alert("GPUXidError", node="m1", xid="79")]))


def check_webhook(body: bytes) -> None:
    try:
        parsed = parse_payload(body)
    except PayloadError as err:
        assert str(err) and "\n" not in str(err)
        return
    for one in parsed.alerts:
        parse_time(one.startsAt)
        try:
            mapping = RULES.map(one, 1.7e9)
        except Unmapped:
            continue
        JobSubjects(mapping.job or "j").heartbeat(mapping.machine)  # a valid machine name


@PROPERTY
@given(st.binary(max_size=4096))
def test_webhook_bodies_arbitrary_bytes(body: bytes) -> None:
    check_webhook(body)


@PROPERTY
@given(st.randoms(use_true_random=False), json_values)
def test_webhook_bodies_mutated(rng: random.Random, value: Any) -> None:
    check_webhook(json.dumps(mutate(VALID_BODY, rng, value)).encode())


@PROPERTY
@given(st.text(max_size=60))
def test_alert_times_never_crash(text: str) -> None:
    result = parse_time(text)
    assert result is None or isinstance(result, float)


# --- the fuzz run ----------------------------------------------------------------------


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=2048),
        st.tuples(st.sampled_from(SAMPLES), st.randoms(use_true_random=False), json_values).map(
            lambda t: json.dumps(mutate(json.loads(t[0].model_dump_json()), t[1], t[2])).encode()
        ),
    )
)
def test_fuzz_run_every_decoder(raw: bytes) -> None:
    """A few thousand hostile inputs through every decoder, as one bounded run."""
    for model in MODELS:
        check_decoder(model, raw)
    check_event_decoder(raw)
    check_webhook(raw)


async def test_fuzzed_commands_never_stop_a_sidecar(nc, job) -> None:
    """Hostile commands over the real bus: each gets an answer (ok=False, dead-lettered),
    and the command server still runs valid commands afterwards."""
    await bus.ensure_job(nc.jetstream(), job)
    ran: list[str] = []

    async def handler(command: Command) -> dict[str, Any]:
        ran.append(command.command_id)
        return {}

    server = bus.CommandServer(nc, job, "m0", handler)
    await server.start()
    subject = JobSubjects(job).command("m0")
    rng = random.Random(8)
    valid = json.loads(Command(job=job, machine="m0", op="status").model_dump_json())
    junk = [b"", b"\xff\xfe", b"{", b"[]", b"null", json.dumps({**valid, "machine": "m1"}).encode()]
    for _ in range(150):
        junk.append(
            json.dumps(mutate(valid, rng, rng.choice([None, 1, "x", [], {}, 1e308]))).encode()
        )
    try:
        rejected = 0
        for raw in junk:
            msg = await nc.request(subject, raw, timeout=10)
            reply = decode(CommandReply, msg.data)
            rejected += not reply.ok
        assert rejected >= 6  # at least the hand-written junk; a mutation may stay valid
        ok = await bus.request(nc, Command(job=job, machine="m0", op="status"))
        assert ok.ok
        info = await nc.jetstream().stream_info(JobSubjects(job).stream("DEADLETTER"))
        assert info.state.messages >= rejected
    finally:
        await server.stop()
