"""`LazyWorld` in one process: three ranks as threads over a real TCPStore and real gloo
groups. When the world group is built, when it is kept, and what a rank that waits for
the others gets when they never come."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from trainmover.runtime import logs
from trainmover.runtime.abort import AbortSignal, StepAborted
from trainmover.runtime.build import GroupBuilder
from trainmover.runtime.plan import GroupSpec, RankRef
from trainmover.runtime.storeclient import Store
from trainmover.runtime.world import LazyWorld, WorldGroupTimeout

SIZE = 3
CPU = torch.device("cpu")


class Ranks:
    """SIZE ranks' LazyWorlds over one store, each at the slot the test sets."""

    def __init__(self, timeout_s: float = 30.0):
        self.master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.slot = "e0/1"
        self.signals = [AbortSignal("e0", timeout_s) for _ in range(SIZE)]
        self.worlds = [self._world(r, timeout_s) for r in range(SIZE)]

    def _client(self) -> Store:
        return Store(f"127.0.0.1:{self.master.port}", 60)

    def _world(self, rank: int, timeout_s: float) -> LazyWorld:
        me = RankRef(machine=f"m{rank}", local_rank=0)
        signal = self.signals[rank]

        def build(specs: list[GroupSpec], name: str) -> GroupBuilder:
            return GroupBuilder(
                specs, me, self._client().raw, "job", CPU, timeout_s, signal
            ).start()

        return LazyWorld(
            me,
            "job",
            rank,
            SIZE,
            slot=lambda: self.slot,
            store=self._client,
            build=build,
            signal=signal,
            timeout_s=timeout_s,
            log=lambda: logs.get_logger(rank=rank),
        )

    def on(self, ranks: list[int], fn: Callable[[LazyWorld], object]) -> list[object]:
        with ThreadPoolExecutor(len(ranks)) as pool:
            return list(pool.map(lambda r: fn(self.worlds[r]), ranks))

    def all_reduce(self, ranks: list[int] | None = None) -> list[tuple[int, float]]:
        """Each rank's world incarnation and the sum of (rank + 1) over the group."""

        def one(world: LazyWorld) -> tuple[int, float]:
            group = world.current()
            t = torch.tensor([world.rank + 1.0])
            group.backend.allreduce([t]).wait()
            return group.incarnation, t.item()

        return self.on(ranks or list(range(SIZE)), one)  # type: ignore[return-value]

    def close(self) -> None:
        for world in self.worlds:
            world.close()


@pytest.fixture
def ranks():
    r = Ranks()
    yield r
    r.close()


def test_built_at_first_use_kept_while_nobody_switches(ranks: Ranks) -> None:
    assert all(w.built is None for w in ranks.worlds)
    first = ranks.all_reduce()
    assert [s for _, s in first] == [6.0] * SIZE
    again = ranks.all_reduce()  # the same slot: no barrier, the same groups
    ranks.slot = "e0/2"
    later = ranks.all_reduce()  # a new slot, nobody dropped theirs: kept
    assert [i for i, _ in first] == [i for i, _ in again] == [i for i, _ in later]


def test_one_rank_that_switched_makes_every_rank_build_again(ranks: Ranks) -> None:
    before = ranks.all_reduce()
    ranks.worlds[1].drop()  # as a switch does; ranks 0 and 2 know nothing of it
    assert ranks.worlds[1].built is None and ranks.worlds[0].built is not None
    ranks.slot = "e0/3"
    after = ranks.all_reduce()
    assert [s for _, s in after] == [6.0] * SIZE
    assert all(a[0] != b[0] for a, b in zip(after, before, strict=True))
    assert all(w.built is not None and w.built.name == "world.e0.3" for w in ranks.worlds)


def test_ranks_waiting_for_one_that_never_comes_time_out_naming_the_cause() -> None:
    ranks = Ranks(timeout_s=1.0)
    try:
        with pytest.raises(WorldGroupTimeout, match=r"e0/1.*2 of 3 ranks.*rt.process_group"):
            ranks.on([0, 1], lambda w: w.current())
    finally:
        ranks.close()


def test_a_failure_elsewhere_ends_the_wait_with_step_aborted(ranks: Ranks) -> None:
    waiting = threading.Event()
    original = ranks.worlds[0]._wait_all

    def wait_all(*args: object) -> None:
        waiting.set()
        original(*args)  # type: ignore[arg-type]

    ranks.worlds[0]._wait_all = wait_all  # type: ignore[method-assign]
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(ranks.worlds[0].current)
        assert waiting.wait(30)
        ranks.signals[0].set("e0", "a peer died")
        with pytest.raises(StepAborted, match="a peer died"):
            pending.result(timeout=30)


def test_the_barrier_keys_of_a_passed_slot_are_removed(ranks: Ranks) -> None:
    ranks.all_reduce()
    ranks.slot = "e0/2"
    ranks.all_reduce()
    assert not ranks.master.check(["job/world/e0/1/arrived"])
    assert ranks.master.check(["job/world/e0/2/arrived"])
