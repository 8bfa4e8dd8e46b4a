"""The subject, stream and bucket layout of the bus, namespaced by job.

Every name a service or client uses on NATS comes from here, so one bus can serve many
jobs and a producer in another language can find the layout in one place
(docs/messages.md mirrors it).

    tm.<job>.events.<kind>         interruption events (JetStream, stream TM_<job>_EVENTS)
    tm.<job>.plans                 plans from the planner (JetStream, TM_<job>_PLANS)
    tm.<job>.progress              migration progress (JetStream, TM_<job>_PROGRESS)
    tm.<job>.deadletter            rejected input with its reason (JetStream, TM_<job>_DEADLETTER)
    tm.<job>.heartbeat.<machine>   sidecar heartbeats (plain NATS)
    tm.<job>.stats.<machine>       per-machine step statistics (plain NATS)
    tm.<job>.collerr.<machine>     a stayer's collective error naming a peer (plain NATS)
    tm.<job>.stall.<machine>       a voter names the ranks holding a step back (plain NATS)
    tm.<job>.cmd.<machine>         commands to a sidecar (request/reply)
    bucket TM_<job>                cluster state (JetStream key-value)
    bucket TM_<job>_HEALTH         the health-monitor's open incidents
    bucket TM_<job>_EXEC           the executor's migration records
    object store TM_<job>_RECORDS  live ranks' recordings for standbys' shadow iterations

A key-value bucket B is the stream KV_B holding the subjects $KV.B.<key> (`kv_stream`,
`kv_subjects`); the bus permissions (trainmover.security.policy) are derived from here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PREFIX = "tm"

# Job and machine names become subject tokens and stream names: keep them to characters
# that are legal in both and never carry wildcards or separators.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class InvalidName(ValueError):
    """A job or machine name that cannot be used as a subject token."""


def check_name(what: str, value: str) -> str:
    """Returns `value` when it is a valid job or machine name, else raises InvalidName."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise InvalidName(f"invalid {what} name {value!r}: use 1-64 letters, digits, '_' or '-'")
    return value


@dataclass(frozen=True)
class JobSubjects:
    """All subjects, stream names and the bucket name of one job."""

    job: str

    def __post_init__(self) -> None:
        check_name("job", self.job)

    @property
    def root(self) -> str:
        return f"{PREFIX}.{self.job}"

    # --- durable (JetStream) ---------------------------------------------------------
    def event(self, kind: str) -> str:
        return f"{self.root}.events.{kind}"

    @property
    def events(self) -> str:
        """Wildcard over every interruption event of the job."""
        return f"{self.root}.events.*"

    @property
    def plans(self) -> str:
        return f"{self.root}.plans"

    @property
    def progress(self) -> str:
        return f"{self.root}.progress"

    @property
    def deadletter(self) -> str:
        return f"{self.root}.deadletter"

    # --- plain NATS ------------------------------------------------------------------
    def heartbeat(self, machine: str) -> str:
        return f"{self.root}.heartbeat.{check_name('machine', machine)}"

    @property
    def heartbeats(self) -> str:
        return f"{self.root}.heartbeat.*"

    def stats(self, machine: str) -> str:
        return f"{self.root}.stats.{check_name('machine', machine)}"

    @property
    def all_stats(self) -> str:
        return f"{self.root}.stats.*"

    def collective_error(self, machine: str) -> str:
        return f"{self.root}.collerr.{check_name('machine', machine)}"

    @property
    def collective_errors(self) -> str:
        return f"{self.root}.collerr.*"

    def stall(self, machine: str) -> str:
        return f"{self.root}.stall.{check_name('machine', machine)}"

    @property
    def stalls(self) -> str:
        return f"{self.root}.stall.*"

    def command(self, machine: str) -> str:
        return f"{self.root}.cmd.{check_name('machine', machine)}"

    @property
    def commands(self) -> str:
        """Wildcard over every machine's command subject (the executor sends to all)."""
        return f"{self.root}.cmd.*"

    # --- JetStream resources ---------------------------------------------------------
    def stream(self, what: str) -> str:
        """Stream name for `what` in {EVENTS, PLANS, PROGRESS, DEADLETTER}."""
        return f"TM_{self.job}_{what}"

    @property
    def streams(self) -> dict[str, list[str]]:
        """Stream name -> the subjects it captures."""
        return {
            self.stream("EVENTS"): [self.events],
            self.stream("PLANS"): [self.plans],
            self.stream("PROGRESS"): [self.progress],
            self.stream("DEADLETTER"): [self.deadletter],
        }

    @property
    def bucket(self) -> str:
        return f"TM_{self.job}"

    @property
    def health_bucket(self) -> str:
        """The health-monitor's private bucket: open incidents, kept across its restarts."""
        return f"TM_{self.job}_HEALTH"

    @property
    def executor_bucket(self) -> str:
        """The executor's private bucket: one record per migration, for its restarts."""
        return f"TM_{self.job}_EXEC"

    @property
    def records_bucket(self) -> str:
        """The object store of recordings a standby's shadow iterations replay (stream
        OBJ_TM_<job>_RECORDS), when the job keeps them on the bus."""
        return f"TM_{self.job}_RECORDS"

    def buckets(self) -> list[str]:
        """Every key-value bucket of the job."""
        return [self.bucket, self.health_bucket, self.executor_bucket]


def kv_stream(bucket: str) -> str:
    """The JetStream stream behind key-value bucket `bucket`."""
    return f"KV_{bucket}"


def kv_subjects(bucket: str) -> str:
    """Wildcard over the keys of `bucket` (what a writer publishes to)."""
    return f"$KV.{bucket}.>"


def obj_stream(bucket: str) -> str:
    """The JetStream stream behind object-store bucket `bucket`."""
    return f"OBJ_{bucket}"


def obj_subjects(bucket: str) -> list[str]:
    """What a writer of object-store `bucket` publishes to: chunks and metadata."""
    return [f"$O.{bucket}.C.>", f"$O.{bucket}.M.>"]


# Keys of the cluster-state bucket.
STATE_KEY = "cluster"
