"""A real 3-server JetStream cluster on loopback, one per test module (it takes about a
second to form); tests name their jobs apart with the `job` fixture."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from trainmover.natscluster import EmbeddedNatsCluster


@pytest.fixture(scope="module")
def nats_cluster() -> Iterator[EmbeddedNatsCluster]:
    with EmbeddedNatsCluster(3) as cluster:
        yield cluster


@pytest.fixture
def running_cluster(nats_cluster: EmbeddedNatsCluster) -> EmbeddedNatsCluster:
    """The module's cluster with every server up (a test before may have stopped one)."""
    stopped = [i for i, node in enumerate(nats_cluster.nodes) if not node.running]
    for index in stopped:
        nats_cluster.start_node(index)
    if stopped:
        nats_cluster.wait_ready()
    return nats_cluster
