"""Alertmanager webhook bodies as Alertmanager sends them (payload version "4").

Shapes follow Alertmanager's documented webhook_config payload
(https://prometheus.io/docs/alerting/latest/configuration/#webhook_config).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

RULES_FILE = Path(__file__).resolve().parents[2] / "deploy" / "health-monitor-rules.yaml"


def alert(
    name: str, status: str = "firing", fingerprint: str | None = None, **labels_and_notes: str
) -> dict[str, Any]:
    """One alert; keyword args ending up as labels, except drain_deadline/summary (annotations)."""
    annotations = {
        k: labels_and_notes.pop(k) for k in ("drain_deadline", "summary") if k in labels_and_notes
    }
    labels = {"alertname": name, **labels_and_notes}
    fp = fingerprint or hashlib.sha256(json.dumps(labels, sort_keys=True).encode()).hexdigest()[:16]
    return {
        "status": status,
        "labels": labels,
        "annotations": annotations,
        "startsAt": "2024-05-01T10:00:00.123456789Z",
        "endsAt": "0001-01-01T00:00:00Z" if status == "firing" else "2024-05-01T10:05:00Z",
        "generatorURL": "http://prometheus:9090/graph?g0.expr=DCGM_FI_DEV_XID_ERRORS+%3E+0",
        "fingerprint": fp,
    }


def payload(alerts: list[dict[str, Any]], receiver: str = "trainmover") -> bytes:
    """A notification grouping `alerts`, with the fields Alertmanager always sends."""
    status = "firing" if any(a["status"] == "firing" for a in alerts) else "resolved"
    common = dict(alerts[0]["labels"]) if alerts else {}
    for a in alerts[1:]:
        common = {k: v for k, v in common.items() if a["labels"].get(k) == v}
    body = {
        "version": "4",
        "groupKey": '{}:{alertname="' + common.get("alertname", "") + '"}',
        "truncatedAlerts": 0,
        "status": status,
        "receiver": receiver,
        "groupLabels": {"alertname": common["alertname"]} if "alertname" in common else {},
        "commonLabels": common,
        "commonAnnotations": {},
        "externalURL": "http://alertmanager:9093",
        "alerts": alerts,
    }
    return json.dumps(body).encode()
