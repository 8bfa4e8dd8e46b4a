"""The Alertmanager webhook body (payload version "4"), parsed and validated, pure.

This is the JSON Alertmanager really POSTs to a `webhook_configs` receiver:

    {"version": "4", "groupKey": "...", "truncatedAlerts": 0, "status": "firing",
     "receiver": "trainmover", "groupLabels": {...}, "commonLabels": {...},
     "commonAnnotations": {...}, "externalURL": "http://alertmanager:9093",
     "alerts": [{"status": "firing", "labels": {...}, "annotations": {...},
                 "startsAt": "2024-05-01T10:00:00Z", "endsAt": "0001-01-01T00:00:00Z",
                 "generatorURL": "...", "fingerprint": "..."}]}

Fields TrainMover does not use are accepted and ignored, so a newer Alertmanager that
adds fields keeps working; a wrong type or a missing required field is a PayloadError
with a one-line reason (the HTTP layer answers 400 with it).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

SUPPORTED_VERSION = "4"


class PayloadError(ValueError):
    """A webhook body that is not a valid Alertmanager payload; str() is one line."""


class Alert(BaseModel):
    """One alert of a notification; `status` is per alert (a group mixes both)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    status: Literal["firing", "resolved"]
    labels: dict[str, str]
    annotations: dict[str, str] = Field(default_factory=dict)
    startsAt: str = ""
    endsAt: str = ""
    generatorURL: str = ""
    fingerprint: str = ""

    @property
    def alertname(self) -> str:
        return self.labels.get("alertname", "")


class WebhookPayload(BaseModel):
    """One notification: a group of alerts sent to one receiver."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    version: str
    status: Literal["firing", "resolved"]
    alerts: list[Alert]
    receiver: str = ""
    groupKey: str = ""
    truncatedAlerts: int = 0
    groupLabels: dict[str, str] = Field(default_factory=dict)
    commonLabels: dict[str, str] = Field(default_factory=dict)
    commonAnnotations: dict[str, str] = Field(default_factory=dict)
    externalURL: str = ""


def parse_payload(body: bytes) -> WebhookPayload:
    """Validates a webhook body; raises PayloadError naming the first problem."""
    if not body.strip():
        raise PayloadError("empty body: expected an Alertmanager webhook JSON payload")
    try:
        payload = WebhookPayload.model_validate_json(body)
    except ValidationError as err:
        first = err.errors()[0]
        if first["type"] == "json_invalid":
            raise PayloadError(f"malformed JSON: {first['msg']}") from None
        # A key is the sender's text: shown escaped, so the reason stays one line.
        loc = ".".join(str(p).encode("unicode_escape").decode() for p in first["loc"])
        msg = first["msg"]
        raise PayloadError(f"field '{loc}': {msg}" if loc else msg) from None
    if payload.version != SUPPORTED_VERSION:
        raise PayloadError(
            f"field 'version': unsupported webhook payload version {payload.version!r} "
            f"(expected {SUPPORTED_VERSION!r})"
        )
    return payload
