"""The health-monitor's settings, from flags, environment, and config files.

Precedence, highest first: command-line flags, environment variables
(TRAINMOVER_HM_<SETTING>, e.g. TRAINMOVER_HM_HEARTBEAT_INTERVAL=0.5), the `--config`
file (YAML or TOML, keys as the settings below), the `health_monitor:` section and
`job`/`name` of the `--job-config` file (what `trainmover up` passes), then defaults.
The webhook token is read from TRAINMOVER_WEBHOOK_TOKEN or `--webhook-token-file`, never
from a flag, so it does not show in `ps`. NATS credentials come from the shared
`--nats-creds` / $TRAINMOVER_NATS_* settings (trainmover.security.credentials).
"""

from __future__ import annotations

import argparse
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from trainmover.natsserver import URL_ENV
from trainmover.security import credentials
from trainmover.security.credentials import CredentialsError, NatsAuth
from trainmover.subjects import InvalidName, check_name

ENV_PREFIX = "TRAINMOVER_HM_"
TOKEN_ENV = "TRAINMOVER_WEBHOOK_TOKEN"


class ConfigError(ValueError):
    """Settings that cannot work; str() is one line."""


@dataclass
class Settings:
    nats_url: str | None = None
    jobs: list[str] = field(default_factory=list)
    heartbeat_interval: float = 0.5
    """Seconds between a sidecar's heartbeats."""
    heartbeat_timeout_intervals: float = 3.0
    """A machine is lapsed after this many intervals without a heartbeat."""
    startup_grace: float | None = None
    """Seconds a newly watched machine gets for its first heartbeat (default: the timeout)."""
    check_interval: float | None = None
    """How often lapses are checked (default: a tenth of the heartbeat interval)."""
    # A joiner is watched too: it dies silently in phase 1 as easily as anyone, and the
    # planner re-plans its migration only once told (found by the chaos soak).
    watch_statuses: list[str] = field(
        default_factory=lambda: ["active", "standby", "leaving", "joining"]
    )
    straggler_factor: float = 2.0
    straggler_steps: int = 10
    """Consecutive slow steps before a straggler event (and normal ones to clear it)."""
    straggler_window: int = 20
    """Steps per machine that make its median."""
    straggler_retry: float = 30.0
    """Seconds before a straggler the planner turned down may be proposed again (once a
    standby is free, nothing is in flight and its cool-down is over)."""
    starved_grace: float = 30.0
    """Seconds a machine named silent is excused while its heartbeats show it starved of
    a CPU, counted from its first excuse in a step; then its stall is believed (held that
    long, it holds the job as a hung machine does, and one on another host is not
    starved)."""
    silent_fraction: float = 0.25
    """At most this fraction of a job's watched machines (at least one) is failed from
    silence alone within one heartbeat timeout, none while over half are silent; more
    silent at once is a host or bus problem until a peer or the progress board names one
    (`silence.py`)."""
    stall_burst: int = 5
    """Distinct stalls one machine's reports may have believed within `stall_window`
    (a compromised sidecar reporting stall after stall must not burn the standby pool)."""
    stall_window: float = 60.0
    dedup_window: float = 300.0
    """Seconds an incident absorbs repeats of the same machine and kind."""
    rules: str | None = None
    http_host: str = "0.0.0.0"
    http_port: int = 9464
    port_file: str | None = None
    """Where to write the bound HTTP port (useful with --http-port 0)."""
    max_body_bytes: int = 16 * 1024 * 1024
    max_connections: int = 64
    dead_letter_rate: float = 20.0
    """Dead letters per second allowed during a flood (bursts of 10x); the rest are counted."""
    publish_timeout: float = 10.0
    """Seconds a webhook request waits for its events' acks before answering 503."""
    webhook_token: str | None = field(default=None, repr=False)
    nats_auth: NatsAuth | None = field(default=None, repr=False)
    """Credentials from this service's own flags/env; None: the process default."""
    log_format: str | None = None
    log_level: str | None = None

    @property
    def heartbeat_timeout(self) -> float:
        return self.heartbeat_interval * self.heartbeat_timeout_intervals

    @property
    def grace(self) -> float:
        return self.heartbeat_timeout if self.startup_grace is None else self.startup_grace

    @property
    def tick(self) -> float:
        return self.check_interval or max(self.heartbeat_interval / 10, 0.005)

    def validate(self) -> Settings:
        # No job is allowed (the service idles, serving /healthz and /metrics): `trainmover
        # up` starts every service, with or without a job config, and restarts one that
        # exits, so exiting here would only spin.
        try:
            for job in self.jobs:
                check_name("job", job)
        except InvalidName as err:
            raise ConfigError(str(err)) from None
        positive = {
            "heartbeat_interval": self.heartbeat_interval,
            "heartbeat_timeout_intervals": self.heartbeat_timeout_intervals,
            "dedup_window": self.dedup_window,
            "straggler_retry": self.straggler_retry,
            "starved_grace": self.starved_grace,
            "stall_window": self.stall_window,
            "stall_burst": self.stall_burst,
            "dead_letter_rate": self.dead_letter_rate,
            "publish_timeout": self.publish_timeout,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ConfigError(f"{name} must be positive, got {value}")
        if not 0 < self.silent_fraction <= 1:
            raise ConfigError(f"silent_fraction must be in (0, 1], got {self.silent_fraction}")
        if self.straggler_factor <= 1:
            raise ConfigError(f"straggler_factor must be > 1, got {self.straggler_factor}")
        if self.straggler_steps < 1 or self.straggler_window < 1:
            raise ConfigError("straggler_steps and straggler_window must be >= 1")
        unknown = set(self.watch_statuses) - {
            "active",
            "standby",
            "leaving",
            "joining",
            "failed",
            "maintenance",
        }
        if unknown:
            raise ConfigError(f"watch_statuses: unknown status {sorted(unknown)}")
        return self


_FIELDS = {f.name: f for f in fields(Settings)}
_LIST_FIELDS = {"jobs", "watch_statuses"}
_SECRET_FIELDS = {"webhook_token", "nats_auth"}


def _read_file(path: str) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text()
        data = tomllib.loads(text) if p.suffix == ".toml" else yaml.safe_load(text)
    except (OSError, yaml.YAMLError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"config file {path}: {str(err).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping at the top level")
    return data


def _coerce(name: str, value: Any, origin: str) -> Any:
    kind = _FIELDS[name].type
    try:
        if name in _LIST_FIELDS:
            if isinstance(value, str):
                return [v.strip() for v in value.split(",") if v.strip()]
            return [str(v) for v in value]
        if value is None:
            return None
        if "float" in str(kind):
            return float(value)
        if "int" in str(kind):
            return int(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{origin}: {name}: invalid value {value!r}") from None


def _from_mapping(data: dict[str, Any], origin: str) -> dict[str, Any]:
    out = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name == "job":
            name, value = "jobs", [value] if isinstance(value, str) else value
        if name not in _FIELDS or name in _SECRET_FIELDS:
            raise ConfigError(f"{origin}: unknown setting {key!r}")
        out[name] = _coerce(name, value, origin)
    return out


def _from_job_config(path: str) -> dict[str, Any]:
    """The job name and the `health_monitor:` section of a job config file."""
    data = _read_file(path)
    out: dict[str, Any] = {}
    section = data.get("health_monitor") or data.get("health-monitor") or {}
    if section:
        if not isinstance(section, dict):
            raise ConfigError(f"job config {path}: health_monitor must be a mapping")
        out.update(_from_mapping(section, f"job config {path} [health_monitor]"))
    job = data.get("job") or data.get("name")
    if isinstance(job, dict):
        job = job.get("name")
    if isinstance(job, str) and "jobs" not in out:
        out["jobs"] = [job]
    return out


def _from_env(env: dict[str, str]) -> dict[str, Any]:
    out = {}
    for name in _FIELDS:
        if name in _SECRET_FIELDS or name == "nats_url":
            continue
        value = env.get(ENV_PREFIX + name.upper())
        if value is not None:
            out[name] = _coerce(name, value, f"${ENV_PREFIX}{name.upper()}")
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="trainmover service health-monitor",
        description="Turns heartbeats, worker exits, step statistics and Alertmanager "
        "alerts into interruption events.",
    )
    a = p.add_argument
    a("--nats-url", help=f"NATS server(s); default ${URL_ENV}")
    a("--job", dest="jobs", action="append", metavar="NAME", help="job to watch (repeatable)")
    a("--job-config", help="job config file (job name and a health_monitor: section)")
    a("--config", help="health-monitor config file (YAML or TOML)")
    a("--heartbeat-interval", type=float, metavar="S", help="sidecar heartbeat interval (0.5)")
    a("--heartbeat-timeout-intervals", type=float, metavar="N", help="missed intervals (3)")
    a("--startup-grace", type=float, metavar="S", help="first-heartbeat grace (the timeout)")
    a("--check-interval", type=float, metavar="S", help="lapse check period (interval/10)")
    a("--watch-statuses", help="comma list of machine statuses to watch")
    a("--straggler-factor", type=float, help="slow = above factor x job median (2.0)")
    a("--straggler-steps", type=int, help="consecutive slow steps to flag (10)")
    a("--straggler-window", type=int, help="steps per machine median (20)")
    a("--straggler-retry", type=float, metavar="S", help="re-propose a rejected straggler (30)")
    a("--starved-grace", type=float, metavar="S", help="excuse a starved silent machine (30)")
    a("--silent-fraction", type=float, metavar="F", help="most of a job failed by silence (0.25)")
    a("--dedup-window", type=float, metavar="S", help="incident dedup window (300)")
    a("--rules", metavar="FILE", help="alert rules file (YAML or TOML)")
    a("--http-host", help="webhook/metrics listen address (0.0.0.0)")
    a("--http-port", type=int, help="webhook/metrics port (9464; 0 picks one)")
    a("--port-file", help="write the bound HTTP port to this file")
    a("--max-body-bytes", type=int, help="largest webhook body (16 MiB)")
    a("--max-connections", type=int, help="concurrent HTTP connections (64)")
    a("--dead-letter-rate", type=float, help="dead letters per second in a flood (20)")
    a("--publish-timeout", type=float, metavar="S", help="webhook wait for event acks (10)")
    a("--webhook-token-file", help=f"bearer token file (or ${TOKEN_ENV})")
    a("--log-format", choices=["json", "console"])
    a("--log-level")
    credentials.add_arguments(p)
    return p


def load(argv: list[str] | None, env: dict[str, str] | None = None) -> Settings:
    """Settings from flags, environment and files; raises ConfigError."""
    env = dict(os.environ if env is None else env)
    args = parser().parse_args(argv)
    merged: dict[str, Any] = {}
    if args.job_config:
        merged.update(_from_job_config(args.job_config))
    if args.config:
        merged.update(_from_mapping(_read_file(args.config), f"config file {args.config}"))
    merged.update(_from_env(env))
    try:
        auth = credentials.from_args(args, env)
    except CredentialsError as err:
        raise ConfigError(str(err)) from None
    if auth != NatsAuth():
        merged["nats_auth"] = auth
    for name in _FIELDS:
        if name in _SECRET_FIELDS:
            continue
        value = getattr(args, name, None)
        if value is not None:
            merged[name] = _coerce(name, value, f"--{name.replace('_', '-')}")
    merged["nats_url"] = args.nats_url or env.get(URL_ENV) or merged.get("nats_url")
    if args.webhook_token_file:
        try:
            merged["webhook_token"] = Path(args.webhook_token_file).read_text().strip()
        except OSError as err:
            raise ConfigError(f"--webhook-token-file: {err}") from None
    elif env.get(TOKEN_ENV):
        merged["webhook_token"] = env[TOKEN_ENV]
    return Settings(**merged).validate()
