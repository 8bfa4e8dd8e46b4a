"""The health_monitor service."""
