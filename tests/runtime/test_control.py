"""The control channel: typed requests, replies, errors and events over JSON lines."""

import queue
import socket

import pytest

from trainmover.runtime import control as c
from trainmover.runtime import controlconn


@pytest.fixture
def pair():
    left, right = socket.socketpair()
    events: queue.Queue = queue.Queue()

    def on_request(msg):
        if isinstance(msg, c.Commit):
            if msg.step < 0:
                raise ValueError("negative step")
            return c.CommitAck(accepted=True, passed=msg.step - 1)
        return c.Ack()

    worker = controlconn.Connection(left, on_request=on_request).start()
    supervisor = controlconn.Connection(right, on_event=events.put).start()
    yield supervisor, worker, events
    worker.close()
    supervisor.close()


def test_request_gets_its_typed_reply(pair):
    supervisor, _, _ = pair
    ack = supervisor.request(c.Commit(plan_id="p1", step=7), timeout_s=5)
    assert ack == c.CommitAck(accepted=True, passed=6)


def test_handler_error_becomes_remote_error(pair):
    supervisor, _, _ = pair
    with pytest.raises(controlconn.RemoteError, match="negative step"):
        supervisor.request(c.Commit(plan_id="p1", step=-1), timeout_s=5)


def test_events_arrive_in_order(pair):
    _, worker, events = pair
    for step in (1, 2):
        worker.notify(c.StepDone(step=step, t_end=0.0, seconds=0.1))
    assert [events.get(timeout=5).step for _ in range(2)] == [1, 2]


def test_closed_connection_fails_pending_requests(pair):
    supervisor, worker, _ = pair

    def die(msg):  # the worker goes away instead of answering
        worker.close()
        return c.Ack()

    worker.on_request = die
    with pytest.raises(ConnectionError):
        supervisor.request(c.Status(), timeout_s=5)


def test_every_message_has_a_json_schema():
    schemas = c.schemas()
    assert {"prepare", "commit", "advance", "status", "stop", "switched"} <= set(schemas)
    assert "plan" in schemas["prepare"]["properties"]
