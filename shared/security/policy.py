"""The least-privilege permission table: what each component may publish and subscribe.

Every grant is derived from `subjects.JobSubjects`, so the layout lives in one place.
A component is a role plus the job(s) it serves (and, for a sidecar, its machine):

    admin           everything (operators' tooling; keep its secret offline)
    planner         job events/progress in, plans/progress out, owns the state bucket
    executor        plans in, progress out, commands to any sidecar of the job
    health-monitor  heartbeats/stats/collective errors in, events out, its own bucket
    sidecar         heartbeats/stats/collective errors of ITS machine out, commands of
                    ITS machine in (answers them), dead letters; reads ITS job's state;
                    its workers record into and replay from ITS job's records bucket
    client          drain/failure/rebalance events of ITS job out; reads the job's
                    state bucket and follows its events and progress

Each non-admin component gets a private reply inbox `_INBOX.<name>` (its connection
uses it as inbox prefix), so nobody can read another component's request replies —
a shared `_INBOX.>` would let a client read other jobs' state as it passes by.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from trainmover.security.denials import subject_matches
from trainmover.subjects import (
    JobSubjects,
    check_name,
    kv_stream,
    kv_subjects,
    obj_stream,
    obj_subjects,
)

Role = Literal["admin", "planner", "executor", "health-monitor", "sidecar", "client"]
ROLES: tuple[Role, ...] = ("admin", "planner", "executor", "health-monitor", "sidecar", "client")
SERVICE_ROLES: tuple[Role, ...] = ("planner", "executor", "health-monitor")

INBOX_ROOT = "_INBOX"
JS_API = "$JS.API"

# Destructive JetStream operations no component but admin may do, denied explicitly so
# a future broader allow (a wildcard) cannot grant them by accident.
_DESTRUCTIVE = [
    f"{JS_API}.STREAM.DELETE.>",
    f"{JS_API}.STREAM.PURGE.>",
    f"{JS_API}.STREAM.MSG.DELETE.>",
    f"{JS_API}.ACCOUNT.>",
    f"{JS_API}.META.>",
    f"{JS_API}.SERVER.>",
]


@dataclass(frozen=True)
class Component:
    """One identity on the bus: a role, the jobs it serves, and a sidecar's machine."""

    role: Role
    jobs: tuple[str, ...] = ()
    machine: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r} (choose from {', '.join(ROLES)})")
        for job in self.jobs:
            check_name("job", job)
        if self.role in ("sidecar", "client") and len(self.jobs) != 1:
            raise ValueError(f"a {self.role} serves exactly one job, got {list(self.jobs)}")
        if (self.role == "sidecar") != (self.machine is not None):
            raise ValueError("a sidecar, and only a sidecar, names its machine")
        if self.machine is not None:
            check_name("machine", self.machine)

    @property
    def name(self) -> str:
        """The user name: `planner`, `client.<job>`, `sidecar.<job>.<machine>`."""
        if self.role == "sidecar":
            return f"sidecar.{self.jobs[0]}.{self.machine}"
        if self.role == "client":
            return f"client.{self.jobs[0]}"
        return self.role

    @property
    def inbox_prefix(self) -> str:
        """The private reply inbox this component's connection must use."""
        return f"{INBOX_ROOT}.{self.name}"

    @property
    def file_stem(self) -> str:
        """A file name for its credentials (names are already safe characters)."""
        return self.name


@dataclass
class Permissions:
    """nats-server `permissions {}` of one user; deny wins over allow."""

    publish_allow: list[str] = field(default_factory=list)
    publish_deny: list[str] = field(default_factory=list)
    subscribe_allow: list[str] = field(default_factory=list)
    subscribe_deny: list[str] = field(default_factory=list)
    allow_responses: bool = False

    def add(self, publish: Iterable[str] = (), subscribe: Iterable[str] = ()) -> None:
        for subject in publish:
            if subject not in self.publish_allow:
                self.publish_allow.append(subject)
        for subject in subscribe:
            if subject not in self.subscribe_allow:
                self.subscribe_allow.append(subject)


# --- JetStream grants --------------------------------------------------------------------


def stream_read(stream: str) -> list[str]:
    """Publish rights to read `stream`: info, ephemeral/ordered consumers, direct get,
    pull fetch, flow-control replies and acks of its deliveries."""
    return [
        f"{JS_API}.STREAM.INFO.{stream}",
        f"{JS_API}.CONSUMER.CREATE.{stream}",
        f"{JS_API}.CONSUMER.CREATE.{stream}.>",
        f"{JS_API}.CONSUMER.INFO.{stream}.*",
        f"{JS_API}.CONSUMER.DELETE.{stream}.*",
        f"{JS_API}.CONSUMER.MSG.NEXT.{stream}.*",
        f"{JS_API}.DIRECT.GET.{stream}",
        f"{JS_API}.DIRECT.GET.{stream}.>",
        f"{JS_API}.STREAM.MSG.GET.{stream}",
        f"$JS.FC.{stream}.>",
        f"$JS.ACK.{stream}.>",
    ]


def stream_durable(stream: str) -> list[str]:
    """Publish rights to create and use durable consumers of `stream` (services)."""
    return [
        *stream_read(stream),
        f"{JS_API}.CONSUMER.DURABLE.CREATE.{stream}.*",
        f"{JS_API}.CONSUMER.LIST.{stream}",
        f"{JS_API}.CONSUMER.NAMES.{stream}",
    ]


def stream_manage(stream: str) -> list[str]:
    """Publish rights to create or update `stream` (idempotent setup at service start)."""
    return [
        f"{JS_API}.STREAM.INFO.{stream}",
        f"{JS_API}.STREAM.CREATE.{stream}",
        f"{JS_API}.STREAM.UPDATE.{stream}",
    ]


def kv_read(bucket: str) -> list[str]:
    """Get, list keys and watch `bucket`."""
    return stream_read(kv_stream(bucket))


def kv_write(bucket: str) -> list[str]:
    """Put and delete keys of `bucket` (a delete is a put with a marker header)."""
    return [kv_subjects(bucket)]


def kv_manage(bucket: str) -> list[str]:
    return stream_manage(kv_stream(bucket))


def object_store_use(bucket: str) -> list[str]:
    """Create object-store `bucket`, put objects into it and read them back (what
    nats-py's object_store, create_object_store, put, get and list ask for).

    A put that replaces an object purges the old object's chunks, so the user may purge
    this one stream; nothing in the grant reaches another stream.
    """
    stream = obj_stream(bucket)
    return [
        *stream_manage(stream),
        *stream_read(stream),
        *obj_subjects(bucket),
        f"{JS_API}.STREAM.PURGE.{stream}",
    ]


def _job_setup(s: JobSubjects) -> list[str]:
    """What `bus.ensure_job` needs: the job's streams and its state bucket."""
    out: list[str] = []
    for stream in s.streams:
        out += stream_manage(stream)
    return out + kv_manage(s.bucket)


# --- the table ---------------------------------------------------------------------------


def _planner(p: Permissions, s: JobSubjects) -> None:
    # Standby heartbeats admit machines to the pool; step statistics name the slowest
    # machine for a rebalance. Both arrive on subjects only each machine may publish.
    p.add(subscribe=[s.heartbeats, s.all_stats])
    p.add(publish=[s.plans, s.progress, s.deadletter, s.events])
    p.add(publish=_job_setup(s))
    for what in ("EVENTS", "PLANS", "PROGRESS"):
        p.add(publish=stream_durable(s.stream(what)))
    p.add(publish=kv_read(s.bucket) + kv_write(s.bucket))


def _executor(p: Permissions, s: JobSubjects) -> None:
    p.add(publish=[s.progress, s.deadletter, s.events, s.commands])
    p.add(publish=_job_setup(s))
    for what in ("EVENTS", "PLANS", "PROGRESS"):
        p.add(publish=stream_durable(s.stream(what)))
    p.add(publish=kv_read(s.bucket))
    # Its migration records, resumed after a restart.
    p.add(publish=kv_manage(s.executor_bucket) + kv_read(s.executor_bucket))
    p.add(publish=kv_write(s.executor_bucket))


def _health_monitor(p: Permissions, s: JobSubjects) -> None:
    p.add(subscribe=[s.heartbeats, s.all_stats, s.collective_errors, s.stalls])
    p.add(publish=[s.events, s.deadletter])
    p.add(publish=_job_setup(s))
    p.add(publish=kv_read(s.bucket))
    p.add(publish=kv_manage(s.health_bucket) + kv_read(s.health_bucket))
    p.add(publish=kv_write(s.health_bucket))


def _sidecar(p: Permissions, s: JobSubjects, machine: str) -> None:
    p.add(
        publish=[
            s.heartbeat(machine),
            s.stats(machine),
            s.collective_error(machine),
            s.stall(machine),
            s.deadletter,  # malformed commands it rejected
        ],
        subscribe=[s.command(machine)],
    )
    # Reads the cluster state: its machine's role and the groups' members and generations.
    p.add(publish=kv_read(s.bucket) + [f"{JS_API}.STREAM.NAMES", f"{JS_API}.INFO"])
    # Its machine's workers (same credentials) record shadow-iteration receives, and a
    # standby's replay them, when `runtime.record_store` is on the bus.
    p.add(publish=object_store_use(s.records_bucket))
    # Answers commands on the requester's reply subject, and nothing else of theirs.
    p.allow_responses = True


CLIENT_EVENT_KINDS = ("drain", "failure", "rebalance")
"""Events a client may raise; straggler events come only from the health-monitor."""


def _client(p: Permissions, s: JobSubjects) -> None:
    p.add(publish=[s.event(kind) for kind in CLIENT_EVENT_KINDS])
    p.add(publish=kv_read(s.bucket))
    p.add(publish=stream_read(s.stream("EVENTS")) + stream_read(s.stream("PROGRESS")))


def permissions(component: Component) -> Permissions:
    """The permissions of `component`: only what its role needs for its jobs."""
    p = Permissions()
    if component.role == "admin":
        p.add(publish=[">"], subscribe=[">"])
        return p
    p.add(subscribe=[f"{component.inbox_prefix}.>"])
    # Services find streams by subject (nats-py does when no stream is named); the
    # list of stream names is all it reveals.
    if component.role in SERVICE_ROLES:
        p.add(publish=[f"{JS_API}.STREAM.NAMES", f"{JS_API}.INFO"])
    for job in component.jobs:
        s = JobSubjects(job)
        if component.role == "planner":
            _planner(p, s)
        elif component.role == "executor":
            _executor(p, s)
        elif component.role == "health-monitor":
            _health_monitor(p, s)
        elif component.role == "sidecar":
            assert component.machine is not None
            _sidecar(p, s, component.machine)
        else:
            _client(p, s)
    p.publish_deny = _denied(p.publish_allow)
    return p


def _denied(allowed: list[str]) -> list[str]:
    """`_DESTRUCTIVE`, less a wildcard that would shadow an exact grant (deny wins in
    nats-server): the sidecar's purge of its records stream. Only a grant without
    wildcards lifts a deny, so a broad allow still cannot reach destructive calls."""
    exact = [a for a in allowed if "*" not in a.split(".") and not a.endswith(">")]
    return [d for d in _DESTRUCTIVE if not any(subject_matches(d, a) for a in exact)]


def components_for(
    jobs: dict[str, list[str]], *, admin: bool = True, services: Iterable[Role] = SERVICE_ROLES
) -> list[Component]:
    """Every identity a deployment of `jobs` (job -> its machines) needs: one user per
    service serving all the jobs, one client per job, one sidecar per machine."""
    names = sorted(jobs)
    out = [Component("admin")] if admin else []
    out += [Component(role, tuple(names)) for role in services]
    for job in names:
        out.append(Component("client", (job,)))
        out += [Component("sidecar", (job,), machine) for machine in jobs[job]]
    return out


def describe_table(component: Component) -> list[tuple[str, str]]:
    """(direction, subject) rows of `component`'s rights, for docs and `auth show`."""
    p = permissions(component)
    rows = [("publish", s) for s in p.publish_allow] + [("subscribe", s) for s in p.subscribe_allow]
    if p.allow_responses:
        rows.append(("publish", "reply subjects of requests it received"))
    return rows
