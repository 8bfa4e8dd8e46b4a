"""The environment a sidecar gives each worker process it starts: where the worker's
control channel is, which machine and local rank it is, its job config and run
directory. Torch-free, so that a sidecar can start workers without importing torch."""

from __future__ import annotations

ENV_CONTROL = "TM_CONTROL"
ENV_MACHINE = "TM_MACHINE"
ENV_LOCAL_RANK = "TM_LOCAL_RANK"
ENV_CONFIG = "TM_CONFIG"
ENV_RUN_DIR = "TM_RUN_DIR"
