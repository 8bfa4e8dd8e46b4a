"""A standby's shadow iterations in this process: what they leave behind is measured."""

from collections.abc import Callable
from pathlib import Path

import torch

from trainmover.runtime import control as c
from trainmover.runtime.groups import GroupTable
from trainmover.runtime.layout import Layout, Role
from trainmover.runtime.plan import RankRef
from trainmover.runtime.sandbox import DirectoryRecordStore
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
