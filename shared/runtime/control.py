"""The control API between a supervising process (a machine's sidecar, or the in-process
harness) and the runtime in each worker: typed messages over one local TCP connection per worker.

Wire format: one JSON object per line, ``{"type", "id", "reply_to", "body"}``. A request
carries an ``id`` and gets exactly one reply carrying ``reply_to``; an event carries
neither. Bodies are the pydantic models below (``type`` is each model's ``TYPE``), so a
non-Python supervisor can speak it from the JSON Schemas (`schemas()`).

Supervisor -> worker requests: prepare, commit, advance, status, stop; warm, recover,
abort. Worker -> supervisor: the hello request (answered by welcome) and the events
step, ready, switched, plan_failed, exited; warmed, collective_error, step_aborted.
The connection that carries them is `trainmover.runtime.controlconn`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field

from trainmover.runtime.layout import Role
from trainmover.runtime.plan import GroupSpec, Plan

CONTROL_SCHEMA_VERSION = 1


class Message(BaseModel):
    TYPE: ClassVar[str]


# -- supervisor -> worker ------------------------------------------------------------------


class Prepare(Message):
    """Phase 1: build my groups of the plan's delta in the background (joiners also get
    their role from the plan). Replied at once; `Ready` follows when built."""

    TYPE: ClassVar[str] = "prepare"
    plan: Plan
    #: The rendezvous store (host:port). A standby is not told it before it joins (its
    #: shadow iterations have no path to the live job); empty: the one from welcome.
    store: str = ""


class Commit(Message):
    """Phase 2: switch at the boundary after `step`. Refused when this rank has already
    passed that boundary or its groups are not ready."""

    TYPE: ClassVar[str] = "commit"
    plan_id: str
    step: int


class Advance(Message):
    """Allow steps up to and including `limit` (a rank waits at the boundary after it).
    `last`: the job ends after `limit` instead of its configured last step (a rank
    finishes there, saving its state if the config dumps the last one)."""

    TYPE: ClassVar[str] = "advance"
    limit: int
    last: bool = False


class Status(Message):
    TYPE: ClassVar[str] = "status"
    #: Include a digest of the replicated state (parameters, optimizer, step).
    digest: bool = False


class Warm(Message):
    """A standby runs shadow iterations for each role type ("first", "middle", "last",
    or "only" when PP=1) in a sandbox with no path to the live job. Replied at once;
    `Warmed` follows. Refused once the rank has a role."""

    TYPE: ClassVar[str] = "warm"
    role_types: list[str]
    iterations: int = 2
    #: Names this warm-up's sandbox (the same on every rank of the machine, unique per
    #: request), so a sandbox store file is never reused.
    round_id: str = ""


class Recover(Message):
    """The unplanned path: a machine died. Every live rank of the job gets it (and the
    joiner). Aborts the current epoch (if no rank did yet), discards the in-flight step,
    rebuilds the delta (and any dirty group), restores the joiner from the plan's state
    sources (DP replicas) or every rank from the last common checkpoint, and resumes all
    ranks from the same step in a new epoch (the plan id). `Switched` follows."""

    TYPE: ClassVar[str] = "recover"
    plan: Plan
    store: str = ""


class Abort(Message):
    """Abort the in-flight step of vote epoch `epoch` on every rank (written to the
    store's decision); ignored for a stale epoch. Ranks then wait for `recover`."""

    TYPE: ClassVar[str] = "abort"
    epoch: str
    reason: str = ""


class Stop(Message):
    """Finish at the next step boundary (as if the job had reached its last step)."""

    TYPE: ClassVar[str] = "stop"


class Slow(Message):
    """Fault injection: add `extra_s` of compute to every step from now on (0 undoes it),
    as a throttled or sick machine would; the straggler detector is tested with it."""

    TYPE: ClassVar[str] = "slow"
    extra_s: float = Field(ge=0.0, le=60.0)


class Block(Message):
    """Fault injection: at its next vote this rank waits, forever, in one extra
    collective of its `group` that no peer will join (a deadlocked worker blocked on
    live peers); the hang detector is tested with it."""

    TYPE: ClassVar[str] = "block"
    group: str


class PrepareAck(Message):
    TYPE: ClassVar[str] = "prepare_ack"
    step: int
    building: list[str]


class CommitAck(Message):
    TYPE: ClassVar[str] = "commit_ack"
    accepted: bool
    #: Last step whose boundary this rank has passed.
    passed: int
    reason: str = ""


class Ack(Message):
    TYPE: ClassVar[str] = "ack"


class RecoverAck(Message):
    TYPE: ClassVar[str] = "recover_ack"
    #: The rank's part: "stayer", "source" (sends a joiner its state) or "joiner".
    part: str
    #: Last committed step when the plan arrived (a joiner: -1, unknown yet).
    committed: int


class AbortAck(Message):
    TYPE: ClassVar[str] = "abort_ack"
    #: False for a stale epoch (nothing done).
    aborted: bool
    epoch: str


class RankStatus(Message):
    TYPE: ClassVar[str] = "rank_status"
    machine: str
    local_rank: int
    role: Role | None
    step: int
    limit: int
    #: kind -> {name, generation, incarnation, rank, size}
    groups: dict[str, dict[str, Any]]
    plan_id: str | None
    #: Last step whose optimizer update was committed by every rank.
    last_committed: int = 0
    #: Current vote epoch and whether it is aborted (waiting for recover).
    epoch: str = "e0"
    aborted: bool = False
    digest: str = ""
    #: Last step whose boundary this rank has left (a commit of it is refused).
    passed: int = -1


class Error(Message):
    TYPE: ClassVar[str] = "error"
    message: str


# -- worker -> supervisor ------------------------------------------------------------------


class Hello(Message):
    TYPE: ClassVar[str] = "hello"
    machine: str
    local_rank: int
    pid: int
    #: Local rank 0 of a machine with several ranks: the address (host:port) of the vote
    #: store it serves for them (`trainmover.runtime.machinevote`); empty otherwise.
    machine_store: str = ""
    schema_version: int = CONTROL_SCHEMA_VERSION


class Welcome(Message):
    """The answer to hello: a role and its generation-0 groups, or no role (standby)."""

    TYPE: ClassVar[str] = "welcome"
    job: str
    role: Role | None
    groups: list[GroupSpec]
    limit: int
    store: str
    #: The launch of the machine's workers this rank belongs to (a relaunch is another).
    launch: str = ""
    #: The vote store of this launch's ranks, as its local rank 0 named it in its hello
    #: (`trainmover.runtime.machinevote`), given to a standby too: it is the machine's
    #: own, no path to the live job. Empty: every rank votes in the job's store.
    machine_store: str = ""


class StepDone(Message):
    TYPE: ClassVar[str] = "step"
    step: int
    #: Wall clock (time.time()) at the end of the step, and the step's own duration.
    t_end: float
    seconds: float
    loss: float | None = None
    #: Time spent in the commit vote (the agreement's cost; includes waiting for the
    #: slowest rank).
    vote_s: float = 0.0
    #: The step's own compute: its duration less the time spent waiting in collectives
    #: and in the vote (a machine waiting for a slow peer does not look slow itself) and
    #: less `queued_s` (`trainmover.runtime.steptime`).
    compute_s: float | None = None
    #: Run-queue delay of the training thread outside its waits: runnable, but the
    #: operating system ran something else (a host shared with other processes).
    queued_s: float = 0.0


class Ready(Message):
    TYPE: ClassVar[str] = "ready"
    plan_id: str
    built: list[str]
    build_s: float
    #: Steps this rank completed while its groups were being built (phase 1 overlap).
    steps_during_build: int


class Switched(Message):
    """A rank finished its part of the switch at the boundary after `step`."""

    TYPE: ClassVar[str] = "switched"
    plan_id: str
    step: int
    part: Literal["leaver", "joiner", "stayer", "source"]
    #: Groups this rank replaced (stayer, joiner) or closed (leaver).
    rebuilt: list[str]
    t_start: float
    t_end: float
    transfer_bytes: int = 0
    transfer_s: float = 0.0
    #: Where the joiner's state came from: the leaver (planned), a DP replica
    #: (unplanned) or the last common checkpoint (every rank reloaded it).
    source: Literal["leaver", "replica", "checkpoint"] = "leaver"
    #: Groups outside the delta rebuilt at the same generation because a work of theirs
    #: was abandoned (recovery only).
    repaired: list[str] = Field(default_factory=list)
    #: Recovery: seconds building groups, and the replicated state's digest afterwards.
    build_s: float = 0.0
    digest: str = ""


class Warmed(Message):
    """Shadow iterations done. Nothing of them survives into training; what the process
    keeps is process-wide warmth (imported code, kernels, allocator, compiled graphs)."""

    TYPE: ClassVar[str] = "warmed"
    role_types: list[str]
    #: role type -> seconds of each shadow iteration (the first one is the cold one).
    iteration_s: dict[str, list[float]]
    #: Sandboxed collectives answered from recordings / synthesised / run for real
    #: inside the sandbox (the machine's own TP group).
    replayed: int
    synthesized: int
    local: int
    #: Whether this process knew the rendezvous store while warming (it must not).
    store_known: bool
    #: Storage bytes of tensors the warm-up created that are still alive after it
    #: (measured; 0 when the shadow's models were dropped) and the process's resident
    #: memory afterwards.
    kept_bytes: int
    rss_bytes: int
    #: Set when the warm-up failed (the standby stays usable, cold).
    error: str = ""


class CollectiveErrorEvent(Message):
    """A collective of this rank failed (first failure of an epoch): the sidecar
    publishes it so the health monitor can name the failed machine."""

    TYPE: ClassVar[str] = "collective_error"
    epoch: str
    step: int
    group: str
    #: The machine blamed: the peer of a point-to-point op or of a two-member group.
    peer_machine: str | None
    error: str
    t: float


class StallEvent(Message):
    """This rank waited for the decision of `step` past the stall threshold and the
    progress board names the ranks holding it back (`trainmover.runtime.progress`)."""

    TYPE: ClassVar[str] = "stall"
    epoch: str
    step: int
    #: Culprit machine -> its ranks that did not reach the vote; `silent`: the culprits
    #: whose named ranks all missed every beat (stopped, cut off, or starved of a CPU).
    culprits: dict[str, list[int]]
    silent: list[str] = []
    reason: str
    waited_s: float
    median_step_s: float
    t: float


class StepAbortedEvent(Message):
    """This rank discarded its in-flight step and waits for `recover`."""

    TYPE: ClassVar[str] = "step_aborted"
    epoch: str
    step: int
    last_committed: int
    reason: str
    t: float


class PlanFailed(Message):
    TYPE: ClassVar[str] = "plan_failed"
    plan_id: str
    error: str


class Exited(Message):
    TYPE: ClassVar[str] = "exited"
    reason: Literal["finished", "left", "error"]
    step: int
    error: str = ""


MESSAGES: dict[str, type[Message]] = {
    m.TYPE: m
    for m in (
        Prepare,
        Commit,
        Advance,
        Status,
        Stop,
        Slow,
        Block,
        Warm,
        Recover,
        Abort,
        PrepareAck,
        CommitAck,
        Ack,
        RecoverAck,
        AbortAck,
        RankStatus,
        Error,
        Hello,
        Welcome,
        StepDone,
        Ready,
        Switched,
        Warmed,
        CollectiveErrorEvent,
        StallEvent,
        StepAbortedEvent,
        PlanFailed,
        Exited,
    )
}


def schemas() -> dict[str, dict[str, Any]]:
    """JSON Schema of every control message body, by type."""
    return {t: m.model_json_schema() for t, m in MESSAGES.items()}
