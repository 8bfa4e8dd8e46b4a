"""A standby's shadow iterations in this process: what they leave behind is measured;
how a standby finds the live ranks' recordings."""

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from trainmover.runtime import control as c
from trainmover.runtime import pipelines
from trainmover.runtime.config import JobConfig, records_on_the_bus
from trainmover.runtime.groups import GroupTable
from trainmover.runtime.layout import Layout, Role
from trainmover.runtime.plan import RankRef
from trainmover.runtime.sandbox import (
    DirectoryRecordStore,
    Recorder,
    await_record,
    record_key,
    shapes_key,
)
from trainmover.runtime.shadow import run_shadow

LAYOUT = Layout(tp=1, pp=2, dp=1)
WIDTH = 16


def shadow_keeping(kept: list[torch.Tensor] | None):
    """A shadow step of a small model; with `kept`, each iteration leaks its weights."""

    def build(role: Role, groups: GroupTable) -> Callable[[], object]:
        model = torch.nn.Linear(WIDTH, WIDTH)
        optimizer = torch.optim.Adam(model.parameters())

        def step() -> None:
            model(torch.randn(4, WIDTH)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            if kept is not None:
                kept.append(model.weight.detach().clone())

        return step

    return build


def warm(tmp_path: Path, kept: list[torch.Tensor] | None) -> c.Warmed:
    return run_shadow(
        RankRef(machine="s0", local_rank=0),
        LAYOUT,
        c.Warm(role_types=["first", "last"], iterations=2),
        shadow_keeping(kept),
        DirectoryRecordStore(tmp_path / "records"),
        tmp_path / "sandbox",
        "round1",
        timeout_s=30.0,
        store_known=False,
    )


def test_shadow_iterations_keep_no_tensor(tmp_path: Path) -> None:
    warmed = warm(tmp_path, kept=None)
    assert warmed.role_types == ["first", "last"]
    assert all(len(t) == 2 for t in warmed.iteration_s.values())
    assert warmed.kept_bytes == 0


def test_a_tensor_the_shadow_leaks_is_counted(tmp_path: Path) -> None:
    kept: list[torch.Tensor] = []
    warmed = warm(tmp_path, kept)
    # Two role types, two iterations each: four copies of a WIDTH x WIDTH float32 weight.
    assert len(kept) == 4
    assert warmed.kept_bytes == 4 * WIDTH * WIDTH * 4


class WatchedStore(DirectoryRecordStore):
    """A directory store that says when it was first asked for something, and in which
    order keys were written."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.asked = threading.Event()
        self.written: list[str] = []

    def get(self, key: str) -> bytes | None:
        self.asked.set()
        return super().get(key)

    def put(self, key: str, data: bytes) -> None:
        self.written.append(key)
        super().put(key, data)


def test_a_standby_that_starts_with_the_job_waits_for_the_recording(tmp_path: Path) -> None:
    store = WatchedStore(tmp_path / "records")
    found: list[bool] = []
    waiter = threading.Thread(target=lambda: found.append(await_record(store, "last", 60.0)))
    waiter.start()
    assert store.asked.wait(30)  # it looked, found nothing, and waits
    assert waiter.is_alive()
    recorder = Recorder()
    recorder.tap(0, torch.ones(3))
    recorder.save(store, "last")
    waiter.join(30)
    assert found == [True]


def test_a_recording_that_never_comes_ends_the_wait(tmp_path: Path) -> None:
    assert await_record(DirectoryRecordStore(tmp_path), "first", 0.3) is False


def test_the_recording_is_written_after_the_stage_shapes_it_goes_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A standby that found the recording finds the shapes too."""
    monkeypatch.setattr(pipelines, "describe", lambda: '{"0": [[4, 8]]}')
    store = WatchedStore(tmp_path)
    recorder = Recorder()
    recorder.tap(0, torch.ones(4, 8))
    recorder.save(store, "first")
    assert store.written == [shapes_key("first"), record_key("first")]


def test_a_sidecar_keeps_recordings_on_the_bus_unless_the_job_names_a_store() -> None:
    config = JobConfig(job="j")
    url = "nats://127.0.0.1:4222,nats://127.0.0.1:4223"
    assert records_on_the_bus(config, url).runtime.record_store == url
    own_dir = config.with_updates(runtime={"record_dir": "/shared/records"})
    assert records_on_the_bus(own_dir, url).runtime.record_store == ""
    own_store = config.with_updates(runtime={"record_store": "tls://bus:4222"})
    assert records_on_the_bus(own_store, url).runtime.record_store == "tls://bus:4222"


def needs_a_recording(store: DirectoryRecordStore, tries: list[str]):
    """A shadow build that, like a torch pipeline stage built without shapes, fails
    until its role type was recorded; the live job records meanwhile."""

    def build(role: Role, groups: GroupTable) -> Callable[[], object]:
        role_type = LAYOUT.role_type(role.pp)
        tries.append(role_type)
        if store.get(record_key(role_type)) is None:
            threading.Thread(target=Recorder().save, args=(store, role_type)).start()
            raise RuntimeError("Stage 0: inputs metadata required for recv info")
        return lambda: None

    return build


def shadow_with(tmp_path: Path, build, store: DirectoryRecordStore, wait_s: float) -> c.Warmed:
    return run_shadow(
        RankRef(machine="s0", local_rank=0),
        LAYOUT,
        c.Warm(role_types=["first", "last"], iterations=1),
        build,
        store,
        tmp_path / "sandbox",
        "round2",
        timeout_s=30.0,
        store_known=False,
        records_wait_s=wait_s,
    )


def test_a_stage_that_needs_a_recording_warms_once_a_live_rank_made_one(tmp_path: Path) -> None:
    store, tries = DirectoryRecordStore(tmp_path / "records"), []
    warmed = shadow_with(tmp_path, needs_a_recording(store, tries), store, wait_s=60.0)
    assert warmed.role_types == ["first", "last"]
    assert tries == ["first", "first", "last", "last"]


def test_without_waiting_for_recordings_such_a_stage_fails_its_warm_up(tmp_path: Path) -> None:
    store, tries = DirectoryRecordStore(tmp_path / "records"), []
    with pytest.raises(RuntimeError, match="inputs metadata required"):
        shadow_with(tmp_path, needs_a_recording(store, tries), store, wait_s=0.0)
    assert tries == ["first"]
