"""`bus.follow` keeps delivering a key's values when the server holding its watch dies
(its own module: it kills a server of the module's cluster)."""

from __future__ import annotations

import asyncio

from structlog.testing import capture_logs

from trainmover import bus, replication
from trainmover.natscluster import EmbeddedNatsCluster


async def test_a_followed_key_is_seen_again_when_the_server_of_its_watch_dies(
    running_cluster: EmbeddedNatsCluster, job: str
) -> None:
    """The server holding the watch's consumer is killed (the client, which knows every
    server, reconnects to another one if it was on that one) and a new value is written.
    nats-py's watch stays blind until it has missed two idle heartbeats (10 s);
    `follow` finds the newer value by reading the key while its watch is quiet, delivers
    it, and opens the watch again."""
    nc = await bus.connect(running_cluster.url, "follower")
    kv = await replication.key_value(nc.jetstream(), f"TM_{job}_follow", history=1)
    await kv.put("state", b"v1")
    followed = bus.follow(kv, "state")
    with capture_logs() as opened:
        assert (await anext(followed)).value == b"v1"
    holder = running_cluster.index(await _consumer_server(nc, f"KV_TM_{job}_follow"))
    try:
        assert not [e for e in opened if e["event"] == "watch_stalled"]
        running_cluster.stop_node(holder, kill=True)
        with capture_logs() as logs:
            await bus.through_failover(lambda: kv.put("state", b"v2"), "v2")
            second = await asyncio.wait_for(anext(followed), 120)
            assert second.value == b"v2"
        stalled = [e for e in logs if e["event"] == "watch_stalled"]
        assert stalled and stalled[0]["revision"] == second.revision
        await kv.put("state", b"v3")  # the watch opened again delivers what follows
        assert (await asyncio.wait_for(anext(followed), 120)).value == b"v3"
        await followed.aclose()
    finally:
        await nc.close()
        running_cluster.start_node(holder)
        await asyncio.to_thread(running_cluster.wait_ready)
        await asyncio.to_thread(running_cluster.wait_current, holder)


async def _consumer_server(nc: object, stream: str) -> str:
    """The server holding the one consumer of `stream` (the follower's watch)."""
    js = nc.jetstream()  # type: ignore[attr-defined]
    for _ in range(200):  # a consumer just made may take a moment to be listed
        consumers = await js.consumers_info(stream)
        if consumers:
            assert len(consumers) == 1, [c.name for c in consumers]
            return str(consumers[0].cluster.leader)
        await asyncio.sleep(0.05)
    raise AssertionError(f"no consumer of {stream} listed")
