"""Under `--auth` the rendezvous store admits only the job's own processes.

The attacker knows the store's address (it is in every machine's launch) and speaks
c10d's TCPStore protocol with a plain client: it can neither read the job's keys nor
write an abort decision for a step ahead, and training goes past that step. The job's
own workers (the store secret in their sidecar's environment) train through the gate.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.e2e.conftest import TP1_LONG, WAIT_S
from trainmover.localcluster import LocalCluster
from trainmover.ports import store_addresses

pytestmark = [pytest.mark.timeout(600), pytest.mark.long]


def forge_abort(address: str, key: str) -> str:
    """What a plain TCPStore client got trying to write `key`: the error it met."""
    host, port = store_addresses(address)[0]
    try:
        client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5))
        client.set(key, "abort")
    except RuntimeError as err:
        return str(err) or type(err).__name__
    return ""


@pytest.mark.parametrize("config", [TP1_LONG])
async def test_a_plain_store_client_cannot_abort_the_jobs_steps(
    secure_cluster: LocalCluster,
) -> None:
    cluster, job = secure_cluster, secure_cluster.job
    await cluster.wait_step("m0", 10, WAIT_S)
    ahead = cluster.steps["m0"] + 15
    error = await asyncio.to_thread(
        forge_abort, cluster.stack.rendezvous_address, f"{job}/commit/e0/{ahead}/decision"
    )
    assert error, "a client without the job's store secret wrote into its store"
    await cluster.wait_step("m0", ahead + 10, WAIT_S)
    state = await cluster.client.status(job)
    assert all(state.machines[m].status == "active" for m in cluster.config.cluster.machines), (
        "a machine was failed meanwhile"
    )
