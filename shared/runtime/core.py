"""What the parts of one worker's runtime share: its identity, lock, plans and groups.

`Runtime` (`trainmover.runtime.worker`, the user's front), the planned switch
(`trainmover.runtime.planned`) and the failure recovery (`trainmover.runtime.recovery`)
each hold this one `Core`. Three kinds of thread use it: the control reader thread
answers requests, the training thread crosses step boundaries, builder and waiter
threads build groups and report them ready. `cond` guards `accepted` (the
plan-acceptance state, `trainmover.runtime.acceptance`) and the step in flight; the
groups are swapped only by the training thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch

from trainmover.runtime import controlconn
from trainmover.runtime.abort import AbortSignal
from trainmover.runtime.acceptance import Acceptance
from trainmover.runtime.build import GroupBuilder
from trainmover.runtime.config import JobConfig
from trainmover.runtime.groups import GroupTable
from trainmover.runtime.layout import Role
from trainmover.runtime.plan import GroupSpec, RankRef
from trainmover.runtime.sandbox import RecordStore
from trainmover.runtime.standard import StandardTorch
from trainmover.runtime.state import TrainingState
from trainmover.runtime.storeclient import Store


class SupervisorGone(RuntimeError):
    """The control connection closed: nobody can coordinate this rank any more."""


@dataclass
class Core:
    """One rank's shared runtime state (see the module docstring for who uses what)."""

    me: RankRef
    config: JobConfig
    run_dir: Path
    device: torch.device
    groups: GroupTable
    torch: StandardTorch
    signal: AbortSignal
    records: RecordStore
    log: structlog.stdlib.BoundLogger
    accepted: Acceptance
    checkpoint_root: Path
    cond: threading.Condition = field(default_factory=threading.Condition)
    #: Set once the control connection is open (it calls back into the runtime).
    conn: controlconn.Connection = field(init=False)
    #: The rendezvous store; a standby learns it with `prepare` or `recover`.
    store_address: str = ""
    #: The vote store of this machine's ranks (`trainmover.runtime.machinevote`), from
    #: the welcome; empty where each rank votes in the job's store.
    machine_store: str = ""
    state: TrainingState | None = None
    #: Set once the user's code has built its role and tracked its state (`track`): a
    #: joiner is ready for its switch only then, so that building the model (seconds
    #: for a large one) is part of phase 1, not of the downtime.
    tracked: threading.Event = field(default_factory=threading.Event)
    #: Builds this process started that `Runtime.close` must know about.
    builders: list[GroupBuilder] = field(default_factory=list)
    #: The step whose state this rank took from a DP replica (a failure's joiner): its
    #: parameters are the role's, its per-replica RNGs are the replica's.
    replica_state_at: int | None = None

    @property
    def timeout_s(self) -> float:
        return self.config.runtime.group_timeout_s

    @property
    def committed(self) -> int:
        """The last step this rank committed (0 before training)."""
        return self.state.step if self.state is not None else 0

    def take_role(self, role: Role) -> None:
        """Plays `role` from now on (the role itself is in `accepted`)."""
        self.accepted.role = role
        self.torch.take_role(role, self.store_address)
        self.log = self.log.bind(role=role.key, rank=self.config.layout.global_rank(role))

    def store(self) -> Store:
        """A client of the job's rendezvous store of its own (a thread must not share
        one), failing over between the store's replicas."""
        return Store(self.store_address, self.timeout_s)

    def builder(self, specs: list[GroupSpec], name: str) -> GroupBuilder:
        """Starts building `specs` in the background."""
        builder = GroupBuilder(
            specs,
            self.me,
            self.store().raw,
            self.config.job,
            self.device,
            self.timeout_s,
            self.signal,
            self.config.runtime.transfer_connections,
        )
        # A troubled build is kept to the end: `close` decides how the process exits.
        self.builders = [b for b in self.builders if b.troubled] + [builder]
        return builder.start(name)
