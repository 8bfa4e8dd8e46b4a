"""The sidecar service."""
