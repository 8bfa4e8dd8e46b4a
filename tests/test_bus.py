"""Bus helpers against a real nats-server: job resources, durability, commands, dead letters."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator

import pytest
import structlog
from nats.js.api import ConsumerConfig, DeliverPolicy

from trainmover import bus
from trainmover.bus import durable
from trainmover.messages import Command, DeadLetter, DrainEvent, decode, decode_event
from trainmover.natsserver import EmbeddedNats
from trainmover.subjects import JobSubjects


async def test_ensure_job_is_idempotent(nc, job):
    js = nc.jetstream()
    first = await bus.ensure_job(js, job)
    second = await bus.ensure_job(js, job)
    assert first._name == second._name  # same bucket, not a second one
    names = {s.config.name for s in await js.streams_info()}
    assert set(JobSubjects(job).streams) <= names


async def test_bucket_keys_lists_every_key_written_in_one_request(nc, job):
    js = nc.jetstream()
    bucket = JobSubjects(job).executor_bucket
    kv = await js.create_key_value(bucket=bucket, history=4)
    assert await bus.bucket_keys(js, bucket) == []
    for key in ("migration.b", "migration.a", "migration.b", "migration.c"):
        await kv.put(key, b"{}")
    await kv.delete("migration.c")  # a delete marker: listed, and a read says so
    assert await bus.bucket_keys(js, bucket) == ["migration.a", "migration.b", "migration.c"]


async def test_unreachable_server_is_one_clear_error():
    with pytest.raises(bus.BusUnreachable, match="nothing listens"):
        await bus.connect("nats://127.0.0.1:1", "test")
    with pytest.raises(bus.BusUnreachable, match="invalid NATS URL"):
        await bus.connect("nats://:4222", "test")


async def test_publish_is_deduplicated_by_message_id(nc, job):
    js = nc.jetstream()
    await bus.ensure_job(js, job)
    event = DrainEvent(job=job, machine="m0")
    subject = JobSubjects(job).event("drain")
    first = await bus.publish_durable(js, subject, event, msg_id=event.event_id)
    again = await bus.publish_durable(js, subject, event, msg_id=event.event_id)
    assert not first.duplicate and again.duplicate
    info = await js.stream_info(JobSubjects(job).stream("EVENTS"))
    assert info.state.messages == 1


async def _read_all(js, stream: str, subject: str) -> list[bytes]:
    sub = await js.pull_subscribe(
        subject, stream=stream, config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
    )
    out = []
    try:
        while True:
            msgs = await sub.fetch(100, timeout=0.5)
            out += [m.data for m in msgs]
    except TimeoutError:
        return out
    finally:
        await sub.unsubscribe()


async def test_event_survives_client_reconnect_and_server_restart(tmp_path, job):
    server = EmbeddedNats(store_dir=tmp_path / "js").start()
    try:
        producer = await bus.connect(server.url, "producer")
        await bus.ensure_job(producer.jetstream(), job)
        event = DrainEvent(job=job, machine="m3", deadline_s=60)
        await bus.publish_durable(
            producer.jetstream(), JobSubjects(job).event("drain"), event, msg_id=event.event_id
        )
        await producer.close()

        server.stop(kill=True)  # a crash, not a clean shutdown
        server = EmbeddedNats(store_dir=tmp_path / "js", port=server.port).start()

        consumer = await bus.connect(server.url, "consumer")
        data = await _read_all(
            consumer.jetstream(), JobSubjects(job).stream("EVENTS"), JobSubjects(job).events
        )
        await consumer.close()
        assert [decode_event(d) for d in data] == [event]
    finally:
        server.cleanup()


async def test_request_retries_with_same_id_and_runs_once(nc, job):
    calls: list[str] = []
    release = asyncio.Event()
    seen: list[str] = []

    async def handler(command: Command) -> dict:
        calls.append(command.command_id)
        await release.wait()
        return {"echo": command.args["x"]}

    async def spy(msg):
        seen.append(json.loads(msg.data)["command_id"])
        if len(seen) >= 2:
            release.set()  # the first attempt timed out and was retried

    server = bus.CommandServer(nc, job, "m0", handler)
    await server.start()
    spy_sub = await nc.subscribe(JobSubjects(job).command("m0"), cb=spy)
    client = await bus.connect(nc.connected_url.geturl(), "requester")
    try:
        command = Command(job=job, machine="m0", op="status", args={"x": 7})
        reply = await bus.request(client, command, timeout=0.3, retries=5)
    finally:
        await spy_sub.unsubscribe()
        await server.stop()
        await client.close()
    assert reply.ok and reply.result == {"echo": 7}
    assert calls == [command.command_id]
    assert len(seen) >= 2 and set(seen) == {command.command_id}


async def test_request_without_responder_fails_after_retries(nc, job):
    command = Command(job=job, machine="nobody", op="status")
    with pytest.raises(bus.CommandFailed, match="no reply after 2 attempts"):
        await bus.request(nc, command, timeout=0.2, retries=2)


async def test_handler_error_is_a_failed_reply(nc, job):
    async def handler(command: Command) -> dict:
        raise RuntimeError("joiner not warm")

    server = bus.CommandServer(nc, job, "m1", handler)
    await server.start()
    try:
        reply = await bus.request(nc, Command(job=job, machine="m1", op="prepare"))
    finally:
        await server.stop()
    assert not reply.ok and "joiner not warm" in reply.error


async def test_malformed_command_is_answered_and_dead_lettered(nc, job):
    js = nc.jetstream()
    await bus.ensure_job(js, job)

    async def handler(command: Command) -> dict:
        raise AssertionError("must not run")

    server = bus.CommandServer(nc, job, "m2", handler)
    await server.start()
    try:
        msg = await nc.request(JobSubjects(job).command("m2"), b'{"op": "commit"', timeout=2)
    finally:
        await server.stop()
    assert b"malformed JSON" in msg.data
    letters = await _read_all(
        js, JobSubjects(job).stream("DEADLETTER"), JobSubjects(job).deadletter
    )
    letter = decode(DeadLetter, letters[0])
    assert letter.payload == '{"op": "commit"' and "malformed JSON" in letter.reason


@pytest.mark.parametrize("batch", [1, 16])
async def test_pump_redelivers_what_a_handler_failed_on_in_order(nc, job, batch):
    # batch=1 is a batch split in pieces: the message after the failed one is fetched
    # on its own, before the failed one is redelivered, and must wait for it.
    js = nc.jetstream()
    await bus.ensure_job(js, job)
    subjects = JobSubjects(job)
    events = [DrainEvent(job=job, machine=f"m{i}") for i in range(3)]
    for event in events:
        await bus.publish_durable(js, subjects.event("drain"), event, msg_id=event.event_id)
    sub = await js.pull_subscribe(
        subjects.events, durable=f"pump-{job}", config=ConsumerConfig(ack_wait=30)
    )
    handled: list[str] = []
    recovered = asyncio.Event()
    done = asyncio.Event()

    async def handle(msg) -> None:
        machine = decode_event(msg.data).machine
        if machine == "m1" and not recovered.is_set():
            raise ConnectionError("the bus went away mid-decision")
        handled.append(machine)
        await msg.ack()
        if len(handled) == 3:
            done.set()

    async def recover() -> None:
        recovered.set()

    task = asyncio.create_task(
        bus.pump(sub, handle, job=job, consumer="test", batch=batch, recover=recover)
    )
    try:
        # Redelivered after 1 s (nak), far sooner than the consumer's 30 s ack wait.
        await asyncio.wait_for(done.wait(), 15)
    finally:
        task.cancel()
    assert recovered.is_set()
    assert handled == ["m0", "m1", "m2"]


def test_hold_keeps_later_messages_back_until_every_failed_one_is_handled():
    hold = durable._Hold()
    hold.fail(5)
    hold.fail(3)
    assert not hold.holds_back(2) and not hold.holds_back(3)  # earlier ones go ahead
    assert hold.holds_back(4) and hold.holds_back(6)
    hold.handled(3)
    assert not hold.holds_back(4) and hold.holds_back(6)  # 5 is still out
    hold.handled(1)  # an unrelated older message changes nothing
    assert hold.holds_back(6)
    hold.handled(5)
    assert not hold.holds_back(6)


def test_hold_lets_go_of_a_message_that_never_comes_back():
    clock = [100.0]
    hold = durable._Hold(clock=lambda: clock[0])
    hold.fail(5)
    assert hold.holds_back(6)
    clock[0] += durable.HOLD_MAX_S + 1
    assert not hold.holds_back(6)


@pytest.fixture
def every_level() -> Iterator[None]:
    """Debug calls reach `capture_logs` even after another test of this process set a
    service's log level (a filtering wrapper drops them before any processor)."""
    previous = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    yield
    structlog.configure(**previous)


@pytest.mark.usefixtures("every_level")
def test_an_outage_of_failing_fetches_is_logged_once_with_its_length() -> None:
    now = [100.0]
    outage = durable._FetchOutage("j", "planner", clock=lambda: now[0])
    with structlog.testing.capture_logs() as logged:
        outage.over()  # nothing failed: nothing to say
        for _ in range(20):
            outage.failed(RuntimeError("no leader"))
            now[0] += 0.2
        outage.over()
        outage.over()
        outage.failed(RuntimeError("again"))
    said = [(e["event"], e["log_level"]) for e in logged]
    assert said == [
        ("fetch_failed", "warning"),
        *[("fetch_failed", "debug")] * 19,
        ("fetch_recovered", "info"),
        ("fetch_failed", "warning"),
    ]
    recovered = next(e for e in logged if e["event"] == "fetch_recovered")
    assert recovered["failures"] == 20 and recovered["after_s"] == 4.0


async def test_an_unanswered_attempt_is_given_up_and_sent_again() -> None:
    """A request to a server still catching up after its restart can go unanswered for
    the client's whole timeout; with `attempt_s` it is sent again instead."""
    attempts: list[str] = []
    cancelled = asyncio.Event()

    async def read() -> str:
        attempts.append("sent")
        if len(attempts) == 1:
            try:
                await asyncio.Event().wait()  # never answered
            except asyncio.CancelledError:
                cancelled.set()
                raise
        return "the record"

    got = await bus.through_failover(read, "a record", deadline_s=30, attempt_s=0.05)
    assert got == "the record" and len(attempts) == 2
    assert cancelled.is_set()
    # Without an attempt bound the same read waits on its first attempt.
    attempts.clear()
    waiting = asyncio.create_task(bus.through_failover(read, "a record", deadline_s=30))
    done, _ = await asyncio.wait({waiting}, timeout=0.5)
    assert not done and attempts == ["sent"]
    waiting.cancel()
