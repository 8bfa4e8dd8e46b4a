"""A standby of a machine with several ranks sets up its share of the machine's vote
while it waits (`trainmover.runtime.machinevote`): before any plan names it, its local
rank 0 serves the machine's vote store and its other rank is connected to it. A
failure's joiner then opens no connection to its machine's store on the way to its
first step, where a connect waiting on the name resolver would hold the whole job.

Real processes: a TP2 x DP2 job (two machines of two ranks) and one standby machine;
m1 is SIGKILLed mid-step and the standby takes over from its DP replica."""

from __future__ import annotations

import time
from pathlib import Path

from tests.integration.programs import tcp_sockets
from tests.runtime.conftest import CONFIG, WAIT_S, _fault_env
from trainmover.localjob import LocalJob
from trainmover.runtime.plan import RankRef

STEPS = 12
LISTEN, ESTABLISHED = "0A", "01"


def _connected_to(pid: int, port: int) -> int:
    """How many connections `pid` holds to local port `port`."""
    return sum(
        1 for state, _, remote in tcp_sockets(pid) if state == ESTABLISHED and remote == port
    )


def test_a_standby_holds_its_machine_vote_store_before_a_failure_names_it(
    tmp_path: Path,
) -> None:
    config = CONFIG.with_updates(
        job="standby-tally",
        layout={"tp": 2, "pp": 1, "dp": 2},
        cluster={"machines": ["m0", "m1"]},
        train={"steps": STEPS, "dump_steps": []},
    )
    faults = _fault_env([("m1", 6, "after-allreduce")])
    with LocalJob.launch(
        config, tmp_path, standbys=1, timeout_s=WAIT_S, limit=2, extra_env=faults
    ) as job:
        (standby,) = job.standbys
        rank0, rank1 = (job.procs[RankRef(machine=standby, local_rank=r)].pid for r in (0, 1))
        address = job.machines[standby].machine_store
        port = int(address.rpartition(":")[2])
        assert address.startswith("127.0.0.1:")
        assert any(s == LISTEN and local == port for s, local, _ in tcp_sockets(rank0))
        # Its clients connect on a background thread after the welcome.
        deadline = time.monotonic() + WAIT_S
        while _connected_to(rank1, port) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _connected_to(rank1, port) >= 2, "the standby's rank 1 never joined its store"
        assert job.status()  # the job runs meanwhile, held at step 2

        job.set_limit(STEPS)
        dead, noticed = job.wait_failure(timeout_s=WAIT_S)
        recovery = job.recover(dead, detected_at=noticed, timeout_s=WAIT_S)
        job.finish(timeout_s=WAIT_S)
    assert dead == "m1"
    joined = {r.machine for r, s in recovery.switched.items() if s.part == "joiner"}
    assert joined == {standby}
    assert job.losses().keys() == set(range(1, STEPS + 1))
