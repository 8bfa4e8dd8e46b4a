"""The alert rules file and the mapping of one Alertmanager alert to an event, pure.

A rules file (YAML, or TOML by its `.toml` suffix) says which alerts mean what:

    machine_labels: [node, instance, hostname]  # first label present names the machine
    strip_port: true                            # "gpu-07:9100" -> "gpu-07"
    machine_pattern: '^(?P<machine>[^.]+)'      # optional: "gpu-07.dc1.example" -> "gpu-07"
    job_label: trainmover_job                   # optional; else found in the cluster state
    deadline_annotation: drain_deadline         # "600", "10m", or an RFC 3339 time
    rules:
      - alertname: GPUXidError
        event: failure
      - alertname: NodePlannedMaintenance
        event: drain
        default_deadline_s: 3600
      - alertname: NodeDown
        event: failure
        match: {severity: critical}             # extra labels that must be equal

The first rule whose alertname and `match` labels fit decides; an alert no rule fits is
*unmapped*. deploy/health-monitor-rules.yaml is the shipped example.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainmover.services.health_monitor.alertmanager import Alert

_MACHINE_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m(?!s))?(?:(\d+(?:\.\d+)?)s)?$")


class RulesError(ValueError):
    """A rules file that cannot be loaded; str() names the file and the problem."""


class Unmapped(Exception):
    """An alert that yields no event; str() is the reason, for logs and dead letters."""

    def __init__(self, reason: str, category: str) -> None:
        super().__init__(reason)
        self.category = category
        """'unmapped' (no rule) or 'no_machine' (no usable machine label)."""


class AlertRule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    alertname: str = Field(min_length=1)
    event: Literal["failure", "drain"]
    match: dict[str, str] = Field(default_factory=dict)
    machine_labels: list[str] | None = None
    deadline_annotation: str | None = None
    default_deadline_s: float | None = Field(default=None, gt=0)


class RuleSet(BaseModel):
    """A loaded rules file; `map` turns one alert into an AlertMapping."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    machine_labels: list[str] = Field(
        default_factory=lambda: ["node", "instance", "hostname"], min_length=1
    )
    strip_port: bool = True
    machine_pattern: str | None = None
    job_label: str | None = None
    deadline_annotation: str = "drain_deadline"
    rules: list[AlertRule] = Field(default_factory=list)

    def map(self, alert: Alert, now: float) -> AlertMapping:
        """The event an alert asks for, or raises Unmapped with the reason."""
        rule = self._rule_for(alert)
        labels = rule.machine_labels or self.machine_labels
        machine = self._machine(alert, labels)
        deadline = None
        if rule.event == "drain":
            annotation = rule.deadline_annotation or self.deadline_annotation
            deadline = parse_deadline(alert.annotations.get(annotation, ""), now)
            if deadline is None:
                deadline = rule.default_deadline_s
        job = alert.labels.get(self.job_label) if self.job_label else None
        return AlertMapping(
            kind=rule.event, machine=machine, job=job or None, deadline_s=deadline, rule=rule
        )

    def _rule_for(self, alert: Alert) -> AlertRule:
        name = alert.alertname
        if not name:
            raise Unmapped("alert has no 'alertname' label", "unmapped")
        for rule in self.rules:
            if rule.alertname == name and all(
                alert.labels.get(k) == v for k, v in rule.match.items()
            ):
                return rule
        raise Unmapped(f"no rule maps alertname {name!r}", "unmapped")

    def _machine(self, alert: Alert, labels: list[str]) -> str:
        label = next((lb for lb in labels if alert.labels.get(lb)), None)
        if label is None:
            raise Unmapped(
                f"alert {alert.alertname!r} has none of the machine labels {labels}", "no_machine"
            )
        value = alert.labels[label]
        name = strip_port(value) if self.strip_port else value
        if self.machine_pattern:
            found = re.search(self.machine_pattern, name)
            if not found:
                raise Unmapped(
                    f"label {label}={value!r} does not match machine_pattern", "no_machine"
                )
            name = found.group("machine") if "machine" in found.groupdict() else found.group(0)
        if not _MACHINE_NAME.match(name):
            raise Unmapped(
                f"label {label}={value!r} gives {name!r}, not a valid machine name", "no_machine"
            )
        return name


@dataclass(frozen=True)
class AlertMapping:
    """What one firing alert asks for."""

    kind: Literal["failure", "drain"]
    machine: str
    job: str | None
    """The job named by `job_label`; None to look the machine up in the cluster state."""
    deadline_s: float | None
    rule: AlertRule


def strip_port(value: str) -> str:
    """'gpu-07:9100' -> 'gpu-07', '[fe80::1]:9100' -> 'fe80::1'; other values unchanged."""
    if value.startswith("["):
        end = value.find("]")
        return value[1:end] if end > 0 else value
    host, sep, port = value.rpartition(":")
    if sep and port.isdigit() and ":" not in host:
        return host
    return value


def parse_deadline(text: str, now: float) -> float | None:
    """Seconds until a drain deadline, from '600', '10m', '1h30m' or an RFC 3339 time.

    None when `text` is empty or unreadable (the rule's default applies). A time already
    past gives the smallest allowed deadline: drain now.
    """
    text = text.strip()
    if not text:
        return None
    try:
        seconds = float(text)
        return seconds if seconds > 0 else None
    except ValueError:
        pass
    found = _DURATION.match(text)
    if found and any(found.groups()):
        h, m, s = (float(g) if g else 0.0 for g in found.groups())
        total = h * 3600 + m * 60 + s
        return total if total > 0 else None
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        return None
    return max(when.timestamp() - now, 0.001)


def load_rules(path: str | Path | None) -> RuleSet:
    """Loads a rules file (YAML, or TOML by suffix); no path gives an empty rule set."""
    if path is None:
        return RuleSet()
    path = Path(path)
    try:
        text = path.read_text()
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (OSError, yaml.YAMLError, tomllib.TOMLDecodeError) as err:
        raise RulesError(f"rules file {path}: {str(err).splitlines()[0]}") from None
    try:
        rules = RuleSet.model_validate(data or {})
        if rules.machine_pattern:
            re.compile(rules.machine_pattern)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise RulesError(f"rules file {path}: field '{loc}': {first['msg']}") from None
    except re.error as err:
        raise RulesError(f"rules file {path}: machine_pattern: {err}") from None
    return rules
