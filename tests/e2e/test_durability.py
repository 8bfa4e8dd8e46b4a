"""The nats-server crashes in the middle of a migration: nothing accepted is lost.

JetStream keeps events, plans, progress and the cluster state in file storage; the
embedded server comes back on its port with its state directory and every process
reconnects. The migration in flight completes, an event acked just before the crash is
decided after it, each event is decided exactly once, and training ends bit-identical
to the uninterrupted reference.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import TP1
from tests.e2e.scenarios import drain_through_fault
from trainmover.localcluster import LocalCluster as Cluster

pytestmark = [pytest.mark.timeout(900), pytest.mark.long]

#: The second drain's joiner must be s1: m1, drained first, stays in maintenance (back
#: in a second, it would be a warm standby by the time a loaded host's planner decides
#: the second drain, and its relaunched workers would not be slowed like the others).
TP1_NO_RETURN = TP1.with_updates(cluster={"maintenance_s": 3600.0})


@pytest.mark.parametrize("config", [TP1_NO_RETURN])
async def test_server_restart_mid_migration_loses_nothing(cluster: Cluster, reference) -> None:
    async def crash() -> None:
        await cluster.stack.restart_bus(kill=True)

    await drain_through_fault(cluster, reference, crash)
