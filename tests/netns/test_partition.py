"""A partition, not a kill: a machine's link goes down while its processes keep running.

Real processes in their own network namespaces (tests/netns/conftest.py) form one of the
runtime's groups over gloo through a bridge; the rendezvous store lives in the host
namespace. This is the runtime-level variant of the partition test (no whole local
cluster in namespaces): it shows the two properties the control plane relies on.

1. The survivor gets out of the collective blocked on the cut-off peer within the
   configured failure timeout (its AbortSignal), not after TCP's minutes-long timeouts.
2. The machine is replaced by a new generation of the group; when the link comes back,
   the cut-off member is fenced out: its old-generation group no longer works, and its
   claim of a slot in the current generation is refused by the store (StaleMemberError),
   while the new generation keeps summing without it.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.netns.conftest import Lan, Peer

pytestmark = pytest.mark.timeout(600)

FAILURE_S = 5.0
#: gloo's own timeout, far above the failure timeout: only the abort signal can be what
#: gets the survivor out in time.
GROUP_S = 300.0
ANSWER_S = 180.0


def test_a_partitioned_member_is_replaced_and_fenced_out(lan: Lan) -> None:
    store = dist.TCPStore("0.0.0.0", 0, is_master=True, timeout=timedelta(seconds=60))
    address = f"{lan.host_address}:{store.port}"
    for machine in ("a", "b", "c"):
        lan.add(machine)
    peers = {m: Peer(lan, m, address, FAILURE_S, GROUP_S) for m in ("a", "b", "c")}
    a, b, c = peers["a"], peers["b"], peers["c"]
    try:
        for p in (a, b):
            p.send("join", members=["a", "b"], generation=0)
        assert a.reply(ANSWER_S)["ok"] and b.reply(ANSWER_S)["ok"]
        for _ in range(3):
            a.send("allreduce", value=1)
            b.send("allreduce", value=2)
            assert a.reply(ANSWER_S)["sum"] == b.reply(ANSWER_S)["sum"] == 3

        lan.cut("b")
        a.send("allreduce", value=1)
        b.send("allreduce", value=2)
        stuck_a, stuck_b = a.reply(ANSWER_S), b.reply(ANSWER_S)
        # Both sides give up on their own bound, far below gloo's timeout.
        for stuck in (stuck_a, stuck_b):
            assert not stuck["ok"] and stuck["type"] == "CollectiveError", stuck
            assert f"no progress in {FAILURE_S:.0f}s" in stuck["error"]
            assert stuck["s"] < GROUP_S / 2

        # The replacement takes b's slot in generation 1; the survivor moves with it.
        assert a.call("reset", ANSWER_S, epoch="e1")["ok"]
        for p in (a, c):
            p.send("join", members=["a", "c"], generation=1)
        joined_a, joined_c = a.reply(ANSWER_S), c.reply(ANSWER_S)
        assert joined_a["ok"] and joined_c["ok"] and joined_c["rank"] == 1
        a.send("allreduce", value=1)
        c.send("allreduce", value=10)
        assert a.reply(ANSWER_S)["sum"] == c.reply(ANSWER_S)["sum"] == 11

        # The cable is back: b is alive and still believes in generation 0.
        lan.restore("b")
        old = b.call("allreduce", ANSWER_S, value=2)
        assert not old["ok"], old  # its generation is gone (aborted, its peer left)
        assert b.call("reset", ANSWER_S, epoch="e1")["ok"]
        stale = b.call("join", ANSWER_S, members=["a", "b"], generation=1)
        assert not stale["ok"] and stale["type"] == "StaleMemberError", stale
        assert "belongs to c/0" in stale["error"] or "belongs to" in stale["error"]
        # The current generation never saw b.
        a.send("allreduce", value=1)
        c.send("allreduce", value=10)
        assert a.reply(ANSWER_S)["sum"] == c.reply(ANSWER_S)["sum"] == 11
    finally:
        for p in peers.values():
            p.close()
