"""A standby's read of the pipeline recordings waits out a bus cluster that cannot
answer yet (its own module: it takes the module cluster's servers down)."""

from __future__ import annotations

import concurrent.futures

from trainmover.natscluster import EmbeddedNatsCluster
from trainmover.runtime.records import NatsRecordStore
from trainmover.subjects import JobSubjects


def test_a_standby_read_waits_out_a_server_back_without_its_cluster(
    running_cluster: EmbeddedNatsCluster, job: str
) -> None:
    """Every server stopped, one started again alone: it answers JetStream requests with
    "JetStream system temporarily unavailable" (503) until the others are back. The read
    returns the recording then, instead of failing the standby's warm-up, which would
    leave the machine cold for good."""
    bucket = JobSubjects(job).records_bucket
    writer = NatsRecordStore(running_cluster.url, bucket, "leaver", 60)
    try:
        writer.put("last.pt", b"recorded")
    finally:
        writer.close()
    for index in (1, 2, 0):
        running_cluster.stop_node(index, kill=True)
    running_cluster.start_node(0)
    store = NatsRecordStore(running_cluster.url, bucket, "standby", 60)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            read = pool.submit(store.get, "last.pt")
            # The lone server's requests time out at first, then answer 503 (about 10 s
            # after its start here): the read must end in neither way.
            done, _ = concurrent.futures.wait([read], timeout=15.0)
            assert not done, f"the read ended without the cluster: {read.exception()}"
            for index in (1, 2):
                running_cluster.start_node(index)
            running_cluster.wait_ready()
            assert read.result(timeout=60) == b"recorded"
    finally:
        store.close()
