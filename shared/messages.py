"""Every message TrainMover puts on the bus, as strict pydantic v2 models.

Each message carries `schema_version`; a different version, an unknown `kind`, a missing
or extra field, or a value of the wrong type is rejected by `decode` with a one-line
reason that names the field. docs/schemas/*.json is generated from these models
(`python -m trainmover.schemas`), so producers in other languages validate against the
same contract. The base every message is built on is `trainmover.message_base`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import Field, TypeAdapter, ValidationError, model_validator

from trainmover.message_base import MAX_MESSAGE_BYTES as MAX_MESSAGE_BYTES
from trainmover.message_base import SCHEMA_VERSION as SCHEMA_VERSION
from trainmover.message_base import Message as Message
from trainmover.message_base import MessageError as MessageError
from trainmover.message_base import Name as Name
from trainmover.message_base import new_id as new_id
from trainmover.message_base import now as now
from trainmover.runtime.layout import Layout, MachineRole
from trainmover.runtime.plan import Plan as SwitchPlan

# --- interruption events (health-monitor / client -> planner) ------------------------

EventSource = Literal[
    "client",
    "heartbeat",
    "worker_exit",
    "collective_error",
    "straggler_detector",
    "no_progress",
    "alertmanager",
    "planner",
    "policy",
]


class _Event(Message):
    event_id: str = Field(default_factory=new_id, min_length=1, max_length=128)
    job: Name
    machine: Name
    reason: str = Field(default="", max_length=4096)
    source: EventSource = "client"
    ts: float = Field(default_factory=now)


class DrainEvent(_Event):
    """Planned: move the machine's role away before `deadline_s` seconds from `ts`."""

    kind: Literal["drain"] = "drain"
    deadline_s: float | None = Field(default=None, gt=0)


class FailureEvent(_Event):
    """Unplanned: the machine (or one of its workers) is gone."""

    kind: Literal["failure"] = "failure"
    exit_code: int | None = None


class StragglerEvidence(Message):
    machine_median_s: float = Field(ge=0)
    job_median_s: float = Field(ge=0)
    factor: float = Field(gt=0)
    window: int = Field(ge=1)


class StragglerEvent(_Event):
    """The machine's compute time per step stayed above the job median by `factor`."""

    kind: Literal["straggler"] = "straggler"
    source: EventSource = "straggler_detector"
    evidence: StragglerEvidence


class RebalanceEvent(Message):
    """Operator or policy asks to move a machine (named, or the slowest when None)."""

    kind: Literal["rebalance"] = "rebalance"
    event_id: str = Field(default_factory=new_id, min_length=1, max_length=128)
    job: Name
    machine: Name | None = None
    reason: str = Field(default="", max_length=4096)
    source: EventSource = "client"
    ts: float = Field(default_factory=now)


InterruptionEvent = Annotated[
    DrainEvent | FailureEvent | StragglerEvent | RebalanceEvent, Field(discriminator="kind")
]
EVENT_KINDS = ("drain", "failure", "straggler", "rebalance")


# --- signals (sidecars / workers -> health-monitor) ------------------------------------

WorkerState = Literal["starting", "warming", "running", "standby", "exited"]
HeartbeatStatus = Literal["active", "standby", "leaving", "maintenance"]


class WorkerStatus(Message):
    local_rank: int = Field(ge=0)
    pid: int | None = None
    state: WorkerState
    exit_code: int | None = None
    step: int | None = None
    # The worker process's CPU, sampled by the sidecar (None where it cannot read it):
    # they tell a process starved of a CPU from a stopped or cut-off one.
    cpu_s: float | None = Field(default=None, ge=0, description="CPU seconds used, all threads")
    cpu_wait_s: float | None = Field(
        default=None, ge=0, description="seconds its threads waited runnable for a CPU (summed)"
    )
    runnable_threads: int | None = Field(
        default=None, ge=0, description="its threads running or waiting for a CPU when sampled"
    )


class Heartbeat(Message):
    """Sent by each sidecar every interval; also at once when a worker exits."""

    kind: Literal["heartbeat"] = "heartbeat"
    job: Name
    machine: Name
    seq: int = Field(ge=0)
    status: HeartbeatStatus
    workers: list[WorkerStatus] = Field(default_factory=list, max_length=1024)
    warm_role_types: list[str] = Field(default_factory=list, max_length=16)
    instance: str = Field(
        default="",
        max_length=64,
        description="the incarnation of the machine's workers: new at every (re)launch",
    )
    ts: float = Field(default_factory=now)


class StepStats(Message):
    """Per-machine compute time of one step, excluding time waiting in collectives and
    the vote, and time the OS kept the training thread waiting for a CPU (`queued_s`)."""

    kind: Literal["step_stats"] = "step_stats"
    job: Name
    machine: Name
    step: int = Field(ge=0)
    compute_s: float = Field(ge=0)
    queued_s: float = Field(default=0.0, ge=0)
    vote_s: float = Field(
        default=0.0, ge=0, description="the step's commit vote, its wait for the slowest rank in"
    )
    ts: float = Field(default_factory=now)


class CollectiveErrorReport(Message):
    """A stayer's collective failed; `peer` is the machine it blames."""

    kind: Literal["collective_error"] = "collective_error"
    job: Name
    machine: Name
    peer: Name
    group: str = Field(max_length=128)
    error: str = Field(max_length=4096)
    ts: float = Field(default_factory=now)


class StallReport(Message):
    """A rank of `machine` voted for `step` and waited past the stall threshold; the
    progress board in the store names the machines whose ranks hold the step back
    (`culprits`: machine -> its ranks that did not reach the vote)."""

    kind: Literal["stall"] = "stall"
    job: Name
    machine: Name
    epoch: str = Field(max_length=128)
    step: int = Field(ge=0)
    culprits: dict[Name, list[Annotated[int, Field(ge=0)]]] = Field(min_length=1, max_length=64)
    silent: list[Name] = Field(
        default_factory=list,
        max_length=64,
        description="culprits whose named ranks all missed every beat between the judge's "
        "two reads: stopped, cut off, or starved of a CPU (their heartbeats tell which)",
    )
    reason: str = Field(max_length=4096)
    waited_s: float = Field(ge=0)
    median_step_s: float = Field(ge=0)
    ts: float = Field(default_factory=now)


# --- plans, commands, progress ---------------------------------------------------------

PlanKind = Literal["planned", "unplanned", "checkpoint_restart"]


class Plan(SwitchPlan, Message):
    """The planner's answer to an event: who moves where, the delta, where state comes from.

    The switch itself (moves, the delta's new-generation groups with their members, the
    transfer pairs) is the runtime's `SwitchPlan`, so what a worker executes is exactly
    what the planner published. `state_sources` maps each leaver to the machine its
    joiner gets state from: the leaver itself (planned) or a data-parallel replica
    (unplanned); empty for a checkpoint restart: it spells out the moves' own sources
    (`SwitchPlan.joiner_sources`) for readers of the message, and must agree with them.
    A recovery that superseded others (a
    failure during a recovery) also ends their failure events, `merged_events`.
    """

    kind: Literal["plan"] = "plan"
    event_id: str = Field(min_length=1, max_length=128)
    migration: PlanKind
    state_sources: dict[str, str] = Field(default_factory=dict)
    merged_events: dict[str, str] = Field(
        default_factory=dict,
        description="earlier failure event id -> its machine, recovered by this plan too",
    )
    switch_step: int | None = Field(default=None, ge=0)
    deadline_ts: float | None = None
    retries_left: int = Field(
        default=0,
        ge=0,
        description="times the planner plans this event again when the migration fails "
        "before its switch and its leaver trains on (planned migrations only)",
    )
    ts: float = Field(default_factory=now)

    @model_validator(mode="after")
    def _state_sources_agree(self) -> Plan:
        if self.state_sources != self.joiner_sources():
            raise ValueError(
                f"state_sources {self.state_sources} disagree with the sources of the plan's "
                f"moves {self.joiner_sources()}"
            )
        return self


CommandOp = Literal[
    "warm",
    "prepare",
    "commit",
    "transfer",
    "release",
    "recover",
    "abort",
    "launch",
    "shutdown",
    "status",
    "steps",
    "slow",
    "block",
    "fence",
    "hold",
    "finish",
]


class Command(Message):
    """Executor -> sidecar request; `command_id` makes a retried command idempotent."""

    kind: Literal["command"] = "command"
    command_id: str = Field(default_factory=new_id, min_length=1, max_length=128)
    job: Name
    machine: Name
    op: CommandOp
    plan_id: str | None = None
    args: dict[str, Any] = Field(default_factory=dict)
    ts: float = Field(default_factory=now)


class CommandReply(Message):
    kind: Literal["command_reply"] = "command_reply"
    command_id: str
    ok: bool
    result: dict[str, Any] = Field(default_factory=dict)
    error: str | None = None


MigrationState = Literal[
    "planned",
    "queued",
    "preparing",
    "phase1",
    "committing",
    "recovering",
    "transferring",
    "releasing",
    "done",
    "aborted",
    "failed",
    "retrying",
    "fallback",
    "rejected",
]
# "fallback" is not terminal: it announces that the migration goes the checkpoint-restart
# way; "done" (or "failed") still ends it. Nor is "retrying": a planned migration failed
# before its switch, its leaver trains on, and the planner plans the event again.
TERMINAL_STATES = frozenset({"done", "aborted", "failed", "rejected"})


class MigrationProgress(Message):
    """A migration entered `state`; terminal states end the migration of `event_id`."""

    kind: Literal["progress"] = "progress"
    job: Name
    event_id: str
    plan_id: str | None = None
    state: MigrationState
    detail: str = Field(default="", max_length=4096)
    leaver: Name | None = None
    joiner: Name | None = None
    moves: dict[Name, Name] = Field(
        default_factory=dict,
        description="every leaver -> joiner of the plan (leaver/joiner name the first)",
    )
    downtime_s: float | None = None
    phases: dict[str, float] = Field(default_factory=dict)
    groups_rebuilt: list[str] = Field(
        default_factory=list, description="the delta: groups rebuilt by the migration"
    )
    groups_total: int | None = Field(default=None, description="groups of the whole job")
    ts: float = Field(default_factory=now)


class DeadLetter(Message):
    """Input a service rejected: the raw payload and why, so nothing vanishes silently."""

    kind: Literal["dead_letter"] = "dead_letter"
    job: str
    subject: str
    reason: str
    payload: str
    service: str
    ts: float = Field(default_factory=now)


# --- cluster state (planner-owned, in the job's key-value bucket) ---------------------

MachineStatus = Literal["active", "standby", "joining", "leaving", "failed", "maintenance"]


class MachineState(Message):
    """A machine as the planner sees it; `cell` is the (dp, pp) role it serves if active."""

    status: MachineStatus
    cell: MachineRole | None = None
    warm_role_types: list[str] = Field(default_factory=list)
    instance: str | None = Field(
        default=None,
        description="the incarnation of its workers the planner last admitted or saw active",
    )


class QueuedEvent(Message):
    """An event waiting for a free standby (a drain, or a failure with none free)."""

    event_id: str
    machine: Name
    raw: str
    retries_left: int | None = Field(
        default=None, ge=0, description="a drain planned again: its tries left (Plan)"
    )


class OutboxEntry(Message):
    """A decided publish not yet acked by the bus; `msg_id` makes republishing harmless."""

    subject: str
    msg_id: str
    payload: str


class ClusterState(Message):
    """The planner's view of a job; `revision` grows with every write."""

    kind: Literal["cluster_state"] = "cluster_state"
    job: Name
    layout: Layout
    machines: dict[str, MachineState]
    in_flight: dict[str, Plan] = Field(
        default_factory=dict, description="plan_id -> plan being executed"
    )
    queued: list[QueuedEvent] = Field(default_factory=list)
    handled: dict[str, str] = Field(
        default_factory=dict, description="recent event_id -> outcome or plan_id"
    )
    generations: dict[str, int] = Field(default_factory=dict)
    claimed_generations: dict[str, int] = Field(
        default_factory=dict,
        description="group -> highest generation a cancelled plan claimed (never reused)",
    )
    cooldown_until: dict[str, float] = Field(default_factory=dict)
    outbox: list[OutboxEntry] = Field(default_factory=list)
    revision: int = 0


class ClusterStateHead(Message):
    """Key `cluster` of the job's bucket: the stored pieces the cluster state is made of
    now, each a partial `cluster_state` (`trainmover.bus.clusterstate`), pinned by the
    bucket revision of each of its chunks (key `cluster.<piece>.<chunk>`)."""

    kind: Literal["cluster_state_head"] = "cluster_state_head"
    job: Name
    revision: int = Field(ge=0, description="the cluster_state's revision")
    shards: int = Field(ge=1, description="machine shards: machine m is in crc32(m) % shards")
    pieces: dict[Name, list[Annotated[int, Field(ge=1)]]] = Field(
        description="piece -> bucket revisions of its chunks, in order"
    )
    bytes: int = Field(ge=0, description="the pieces' total size")


# --- decoding ------------------------------------------------------------------------------

M = TypeVar("M", bound=Message)

EVENT_ADAPTER: TypeAdapter[DrainEvent | FailureEvent | StragglerEvent | RebalanceEvent] = (
    TypeAdapter(InterruptionEvent)
)


def _reason(err: ValidationError, tagged: bool = False) -> str:
    first = err.errors()[0]
    # In a tagged union pydantic puts the tag first in the location; the producer
    # knows which kind it sent, so name the field alone.
    parts = first["loc"][1:] if tagged else first["loc"]
    # Keys come from the input: escape them so the reason stays one printable line.
    loc = ".".join(str(p).encode("unicode_escape").decode() for p in parts)
    msg = first["msg"].removeprefix("Value error, ")
    more = f" (+{err.error_count() - 1} more)" if err.error_count() > 1 else ""
    if first["type"] == "json_invalid":
        return f"malformed JSON: {msg}"
    if first["type"] == "union_tag_invalid":
        tag = first.get("ctx", {}).get("tag")
        return f"field 'kind': unknown kind {tag!r}, expected one of {', '.join(EVENT_KINDS)}"
    if first["type"] == "union_tag_not_found":
        return f"field 'kind': missing, expected one of {', '.join(EVENT_KINDS)}"
    return f"field '{loc}': {msg}{more}" if loc else f"{msg}{more}"


def _check_size(raw: bytes | str) -> None:
    if not isinstance(raw, (bytes, bytearray, str)):
        raise MessageError(f"expected JSON bytes or text, got {type(raw).__name__}")
    size = len(raw) if not isinstance(raw, str) else len(raw.encode("utf-8", "surrogatepass"))
    if size > MAX_MESSAGE_BYTES:
        raise MessageError(f"message of {size} bytes exceeds the limit of {MAX_MESSAGE_BYTES}")


def decode(model: type[M], raw: bytes | str) -> M:
    """Parses and validates `raw` JSON as `model`, or raises MessageError with the reason.

    Input larger than MAX_MESSAGE_BYTES is refused before it is parsed; MessageError is
    the only exception any input raises (tests/security fuzz this).
    """
    _check_size(raw)
    try:
        return model.model_validate_json(raw)
    except ValidationError as err:
        raise MessageError(_reason(err)) from None


def decode_event(raw: bytes | str) -> DrainEvent | FailureEvent | StragglerEvent | RebalanceEvent:
    """Parses any interruption event, dispatching on its `kind`; raises MessageError."""
    _check_size(raw)
    try:
        return EVENT_ADAPTER.validate_json(raw)
    except ValidationError as err:
        raise MessageError(_reason(err, tagged=True)) from None


ALL_MESSAGES: dict[str, Any] = {
    "interruption_event": InterruptionEvent,
    "drain_event": DrainEvent,
    "failure_event": FailureEvent,
    "straggler_event": StragglerEvent,
    "rebalance_event": RebalanceEvent,
    "heartbeat": Heartbeat,
    "step_stats": StepStats,
    "collective_error_report": CollectiveErrorReport,
    "stall_report": StallReport,
    "plan": Plan,
    "command": Command,
    "command_reply": CommandReply,
    "migration_progress": MigrationProgress,
    "dead_letter": DeadLetter,
    "cluster_state": ClusterState,
    "cluster_state_head": ClusterStateHead,
}
"""Schema file name -> model (or union) for docs/schemas/."""
