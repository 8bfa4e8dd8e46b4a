"""Deterministic event ids: the same incident seen twice gets the same id.

The id is a hash of (job, machine, kind, anchor), where the anchor names the incident:
an alert's fingerprint and start time, an exited worker's rank, pid and code, the last
heartbeat heard. Published with the id as `Nats-Msg-Id`, a repeat that slips past the
in-process dedup (e.g. across a restart) is still stored once by JetStream.
"""

from __future__ import annotations

import hashlib

ID_PREFIX = "hm-"


def event_id(job: str, machine: str, kind: str, anchor: str) -> str:
    """A stable event id for one incident (at most 43 characters)."""
    digest = hashlib.sha256("\0".join((job, machine, kind, anchor)).encode()).hexdigest()
    return ID_PREFIX + digest[:40]
