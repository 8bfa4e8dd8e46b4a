"""A healthy, training machine is declared failed (a false alarm): it is fenced.

Its role moves to a standby from its data-parallel replica, its sidecar kills its
workers and brings it back as a fresh standby, and at no point do two machines train
one role: the job ends with one holder per role and bit-identical to the reference
(the step in flight when the failure was declared is re-executed, as after a crash).
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import TP1, WAIT_S
from trainmover.localcluster import LocalCluster as Cluster
from trainmover.messages import ClusterState

pytestmark = pytest.mark.timeout(900)


def _holders(state: ClusterState) -> list[tuple[int, int]]:
    return sorted(
        (m.cell.dp, m.cell.pp)
        for m in state.machines.values()
        if m.cell is not None and m.status in ("active", "leaving")
    )


@pytest.mark.parametrize("config", [TP1])
async def test_a_falsely_failed_machine_is_fenced_and_returns_as_a_standby(
    cluster: Cluster, reference
) -> None:
    await cluster.wait_step("m2", 10, WAIT_S)
    before = await cluster.wait_standbys_warm(WAIT_S)
    assert before.machines["m2"].status == "active"
    # The planner learns the instance of m2's workers from its first heartbeats.
    known = await cluster.wait_state(lambda s: s.machines["m2"].instance is not None, WAIT_S)
    old_instance = known.machines["m2"].instance

    event_id = await cluster.client.report_failure(cluster.job, "m2", reason="false alarm")
    done = await cluster.client.wait_for_migration(cluster.job, event_id, timeout=WAIT_S)
    assert done.state == "done" and done.leaver == "m2", done.detail
    joiner = done.joiner

    # The falsely failed machine comes back only as a fresh standby: new workers.
    back = await cluster.wait_state(
        lambda s: s.machines["m2"].status == "standby" and bool(s.machines["m2"].warm_role_types),
        WAIT_S,
    )
    assert back.machines["m2"].instance not in (None, old_instance)
    assert back.machines["m2"].cell is None
    assert back.machines[joiner].status == "active"
    layout = cluster.stack.config.layout  # type: ignore[union-attr]
    assert _holders(back) == sorted((c.dp, c.pp) for c in layout.cells())

    # Only the four role holders finish training; the result is as if nothing happened.
    step, finished = await cluster.finish_soon(WAIT_S)
    assert "m2" not in finished and joiner in finished and len(finished) == 4
    assert cluster.mismatches(await reference(step), step) == []
