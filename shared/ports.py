"""Default HTTP ports of the services' /metrics and /healthz (and the webhook)."""

DEFAULT_HTTP_PORTS: dict[str, int] = {
    "health-monitor": 9464,
    "planner": 9465,
    "executor": 9466,
    "sidecar": 9467,
}
