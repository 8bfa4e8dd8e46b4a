"""Bus helpers over nats-py; `from trainmover import bus` reaches all of them.

One module per job:

- `connection`: `connect` (probe first, one clear error for an unreachable URL; the
  process's credentials, and a refusal of a server that does not check them),
  `publish` and `subscribe` that raise PermissionDenied when the server refuses them.
- `jobs`: `ensure_job` creates a job's streams and key-value bucket idempotently
  (file storage, replicated across a cluster); `job_bucket` opens the bucket;
  `bucket_keys` lists a bucket's keys.
- `durable`: `pump` consumes in order through failed handling, `publish_durable`
  waits for the ack (the message id deduplicates retries), `through_failover` retries
  a write through a leader election, `dead_letter` records rejected input.
- `commands`: `request` sends a Command and retries with the same `command_id`;
  `CommandServer` answers them and replays the reply for a command it already ran.
- `follow`: `follow` yields every new value of a key-value key, checking its watch
  against a direct read while it is quiet (a watch dies with its server).
- `clusterstate`: a job's cluster state stored as pieces under a head, so that no value
  nears the payload limit (`StateStore`, `read_state`, `follow_states`).
"""

from trainmover.bus.commands import CommandFailed, CommandServer, Handler, request
from trainmover.bus.connection import (
    BusAuthFailed,
    BusNotAuthenticated,
    BusUnreachable,
    connect,
    publish,
    resolve_auth,
    subscribe,
)
from trainmover.bus.durable import (
    ATTEMPT_S,
    BUS_FAILOVER_ERRORS,
    DEAD_LETTER_KEEP,
    FAILOVER_S,
    dead_letter,
    publish_durable,
    pump,
    through_failover,
)
from trainmover.bus.follow import follow
from trainmover.bus.jobs import (
    DUPLICATE_WINDOW_S,
    MAX_PAYLOAD,
    bucket_keys,
    ensure_job,
    job_bucket,
    state_until,
)
from trainmover.security.denials import PermissionDenied

__all__ = [
    "ATTEMPT_S",
    "BUS_FAILOVER_ERRORS",
    "DEAD_LETTER_KEEP",
    "DUPLICATE_WINDOW_S",
    "FAILOVER_S",
    "MAX_PAYLOAD",
    "BusAuthFailed",
    "BusNotAuthenticated",
    "BusUnreachable",
    "CommandFailed",
    "CommandServer",
    "Handler",
    "PermissionDenied",
    "bucket_keys",
    "connect",
    "dead_letter",
    "ensure_job",
    "follow",
    "job_bucket",
    "state_until",
    "publish",
    "publish_durable",
    "pump",
    "request",
    "resolve_auth",
    "subscribe",
    "through_failover",
]
