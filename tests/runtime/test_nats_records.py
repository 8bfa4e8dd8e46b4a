"""The NATS object-store record store against a real nats-server with JetStream: the
store itself from two independent clients, then a real job whose live ranks record into
it and whose standby's shadow iterations replay from it."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from trainmover.localjob import LocalJob
from trainmover.natsserver import EmbeddedNats
from trainmover.runtime.config import JobConfig
from trainmover.runtime.layout import Layout
from trainmover.runtime.records import NatsRecordStore, open_record_store
from trainmover.runtime.sandbox import DirectoryRecordStore, Recorder, load_record, record_key
from trainmover.subjects import JobSubjects

# Workers importing torch on a loaded host take minutes to say hello.
pytestmark = pytest.mark.timeout(1200)
WAIT_S = 400.0


@pytest.fixture
def stores(nats_url: str, job: str) -> Iterator[tuple[NatsRecordStore, NatsRecordStore]]:
    """A recording side and a replaying side, each with its own connection and loop."""
    bucket = JobSubjects(job).records_bucket
    live = NatsRecordStore(nats_url, bucket, "test-live")
    standby = NatsRecordStore(nats_url, bucket, "test-standby")
    yield live, standby
    live.close()
    standby.close()


def test_a_recording_put_on_one_side_is_replayed_on_the_other(
    stores: tuple[NatsRecordStore, NatsRecordStore],
) -> None:
    live, standby = stores
    assert standby.get(record_key("last")) is None  # before anything was recorded
    assert standby.size_bytes() == 0

    recorder = Recorder()
    recorder.tap(0, torch.randn(4, 16, 32))
    recorder.tap(3, torch.randn(4, 16, 32))
    size = recorder.save(live, "last")

    replayed = load_record(standby, "last")
    assert sorted(replayed) == [0, 3]
    for tag, tensor in recorder.received.items():
        assert torch.equal(replayed[tag], tensor)
    assert standby.size_bytes() == size > 2 * 4 * 16 * 32 * 4  # two float32 tensors
    assert load_record(standby, "first") == {}

    # A later recording of the same role type replaces the earlier one.
    again = Recorder()
    again.tap(1, torch.ones(2))
    smaller = again.save(live, "last")
    assert sorted(load_record(standby, "last")) == [1]
    assert standby.size_bytes() == smaller


def test_a_store_larger_than_one_chunk_round_trips(
    stores: tuple[NatsRecordStore, NatsRecordStore],
) -> None:
    # nats-py splits objects into 128 KiB chunks; a real recording of a bigger model
    # spans many.
    live, standby = stores
    data = bytes(range(256)) * 4096 + b"tail"
    live.put("big.pt", data)
    assert standby.get("big.pt") == data


def test_the_config_chooses_the_store(tmp_path: Path, job: str, nats_url: str) -> None:
    plain = JobConfig(job=job)
    directory = open_record_store(plain, tmp_path, "test")
    assert isinstance(directory, DirectoryRecordStore)
    assert directory.root == tmp_path / "records"
    on_bus = open_record_store(
        plain.with_updates(runtime={"record_store": nats_url}), tmp_path, "test"
    )
    try:
        assert isinstance(on_bus, NatsRecordStore)
        assert on_bus.bucket == f"TM_{job}_RECORDS"
    finally:
        on_bus.close()
    with pytest.raises(ValueError, match="nats:// or tls:// URL"):
        plain.with_updates(runtime={"record_store": "/shared/records"})


def test_live_ranks_record_into_nats_and_a_standby_replays_from_it(
    tmp_path: Path, job: str, nats_url: str
) -> None:
    # TP1 x PP2 x DP1: two live machines (first and last stage) and one standby, the
    # smallest job with both recorded role types.
    config = JobConfig(job=job, layout=Layout(tp=1, pp=2, dp=1)).with_updates(
        train={"steps": 1_000},
        runtime={"record_store": nats_url, "record_step": 1},
    )
    with LocalJob.launch(config, tmp_path, standbys=1, limit=3, timeout_s=WAIT_S) as job_:
        # Step 1's recordings are stored at its boundary, before step 2 starts.
        job_.wait_step(3)
        warmed = job_.warm(timeout_s=WAIT_S)
        job_.stop_at(3)
    (report,) = warmed.values()
    assert not report.error
    assert report.role_types == ["first", "last"]
    # Every pipeline receive of both role types came from the recordings (2 micro-batches
    # x 2 iterations each); nothing was synthesised (DP=1: no gradient all-reduce).
    assert (report.replayed, report.synthesized) == (2 * 2 * 2, 0)
    assert not (tmp_path / "records").exists()  # nothing went to the directory store

    reader = NatsRecordStore(nats_url, JobSubjects(job).records_bucket, "test-reader")
    try:
        first, last = load_record(reader, "first"), load_record(reader, "last")
        size = reader.size_bytes()
        stored = [reader.get(record_key(t)) or b"" for t in ("first", "last")]
    finally:
        reader.close()
    # The first stage received gradients for its 2 micro-batches (tags 2, 3), the last
    # stage activations (tags 0, 1); each is micro_batch x seq_len x d_model.
    m = config.model
    shape = (config.train.micro_batch_size, m.seq_len, m.d_model)
    assert sorted(first) == [2, 3] and sorted(last) == [0, 1]
    assert all(t.shape == shape for t in (*first.values(), *last.values()))
    print(f"record store: {size} bytes in bucket TM_{job}_RECORDS")
    assert size == sum(len(data) for data in stored) > 4 * torch.Size(shape).numel() * 4


def test_a_standby_read_waits_out_a_bus_that_is_down_for_a_while(tmp_path: Path) -> None:
    """A read made while the server is down (restarting) returns the recording once the
    server is back, instead of failing the standby's warm-up on the first timeout."""
    server = EmbeddedNats(store_dir=tmp_path / "js").start()
    store = NatsRecordStore(server.url, JobSubjects("outage").records_bucket, "t", timeout_s=60)
    try:
        store.put("last.pt", b"recorded")
        server.stop(kill=True)
        deadline = time.monotonic() + 30
        while not store.reconnecting():  # the client has seen the server go
            assert time.monotonic() < deadline, "the client never noticed the outage"
            time.sleep(0.05)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            read = pool.submit(store.get, "last.pt")  # JetStream cannot answer now
            # Longer than one JetStream request's timeout (5 s): the read must not end.
            done, _ = concurrent.futures.wait([read], timeout=7.0)
            assert not done, f"the read ended while the bus was down: {read.exception()}"
            server.start()
            assert read.result(timeout=60) == b"recorded"
    finally:
        store.close()
        server.cleanup()
