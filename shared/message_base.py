"""The base of every bus message: strict, closed, versioned, with the name pattern of
subject tokens and the id and clock every message uses. `trainmover.messages` builds the
messages on it and re-exports these names."""

from __future__ import annotations

import time
import uuid
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

SCHEMA_VERSION = 1

MAX_MESSAGE_BYTES = 1024 * 1024
"""Largest message `decode` accepts (the bus's max_payload is the same)."""

Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
"""A job or machine name: it becomes a subject token."""


def new_id() -> str:
    """A fresh unique id for an event, plan or command."""
    return uuid.uuid4().hex


def now() -> float:
    """Wall-clock time as Unix seconds, the unit of every `ts` field."""
    return time.time()


class MessageError(ValueError):
    """Input that is not a valid message; `str()` is a one-line reason naming the field."""


class Message(BaseModel):
    """Base of every message: strict, closed to unknown fields, versioned."""

    # allow_inf_nan=False: no time, duration or deadline is infinite or NaN, and a NaN
    # would compare false everywhere (a deadline never due, a straggler never slow).
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    schema_version: int = SCHEMA_VERSION

    @field_validator("schema_version")
    @classmethod
    def _supported_version(cls, value: int) -> int:
        if value != SCHEMA_VERSION:
            raise ValueError(
                f"unsupported schema_version {value} (this build speaks {SCHEMA_VERSION})"
            )
        return value

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()
