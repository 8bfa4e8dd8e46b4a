"""The job config file (YAML or JSON): layout, model sizes, training and runtime knobs.

Everything that must be equal on a leaver and its joiner for a bit-identical continuation
(sizes, seed, eager vs compiled, thread count) comes from here, so both read it from the
same file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainmover.runtime.layout import Layout

#: URL schemes of `runtime.record_store` that name a NATS server.
NATS_SCHEMES = ("nats://", "tls://")


class ModelConfig(BaseModel):
    """Sizes of the reference GPT-style decoder."""

    model_config = ConfigDict(frozen=True)

    vocab_size: int = Field(default=64, ge=2)
    d_model: int = Field(default=32, ge=1)
    n_heads: int = Field(default=4, ge=1)
    n_layers: int = Field(default=4, ge=1)
    seq_len: int = Field(default=16, ge=2)
    mlp_ratio: int = Field(default=4, ge=1)
    dropout: float = Field(default=0.1, ge=0.0, lt=1.0)
    #: Bytes of an untrained block every rank's state carries besides its parameters
    #: (a stand-in for a large model's state, for the state-size benchmark; 0: none).
    extra_state_bytes: int = Field(default=0, ge=0)


class TrainConfig(BaseModel):
    """The training loop. Nothing here depends on `steps` (no schedule), so a run of N
    steps is a prefix of a longer run: tests compare states at a common step."""

    model_config = ConfigDict(frozen=True)

    steps: int = Field(default=100, ge=1)
    micro_batches: int = Field(default=2, ge=1)
    micro_batch_size: int = Field(default=4, ge=1)
    lr: float = Field(default=3e-3, gt=0)
    seed: int = 1234
    compile: bool = False
    #: Steps after which every rank writes its full state (for comparisons).
    dump_steps: list[int] = Field(default_factory=list)
    #: Also write it after every N-th step (0: never); a job that trains until it is
    #: stopped (the chaos soak) compares its replicas and the reference at these steps.
    dump_every: int = Field(default=0, ge=0)

    def dumps_at(self, step: int) -> bool:
        """Whether every rank writes its full state after `step`."""
        every = self.dump_every
        return step in self.dump_steps or (every > 0 and step > 0 and step % every == 0)


class RuntimeConfig(BaseModel):
    """How workers talk to each other."""

    model_config = ConfigDict(frozen=True)

    #: "auto" picks cuda (NCCL) when available, else cpu (gloo).
    device: Literal["auto", "cpu", "cuda"] = "auto"
    group_timeout_s: float = Field(default=120.0, gt=0)
    #: Threads per worker; joiner and leaver must match for identical results.
    threads: int = Field(default=1, ge=1)
    #: How long a rank waits in one collective, or in the commit vote, before it gives
    #: up on the step (aborts the epoch). A killed peer's direct neighbours get a
    #: connection error at once and every other rank learns of the abort from the
    #: store, so this only bounds silent hangs.
    failure_timeout_s: float = Field(default=120.0, gt=0)
    #: Hangs: a rank that waited longer than max(stall_floor_s, stall_factor x its
    #: median step) reads the progress board and names whoever holds the step back
    #: (trainmover.runtime.progress). Off, only `failure_timeout_s` ends a hang.
    stall_detection: bool = True
    stall_floor_s: float = Field(default=1.5, gt=0)
    stall_factor: float = Field(default=5.0, gt=1)
    #: The per-step commit agreement (a vote through the store before the optimizer
    #: step). Off only to measure its cost: without it a failure can leave replicas
    #: at different steps.
    commit_agreement: bool = True
    #: Largest piece of a role's state on the wire in a peer transfer (MiB): what a
    #: transfer needs beyond the state itself is a few of these.
    transfer_chunk_mib: float = Field(default=64.0, gt=0)
    #: A checksum per chunk, checked before the state is applied. It reads every byte
    #: once more on each side: free where cores are spare, a quarter of the throughput
    #: on a host whose cores are all busy moving the bytes (docs/benchmarks.md).
    transfer_checksum: bool = True
    #: Connections of a transfer pair (gloo; NCCL picks its own): chunks take turns
    #: over them. Two raised loopback throughput 1.4x here (docs/benchmarks.md).
    transfer_connections: int = Field(default=2, ge=1, le=8)
    #: After a recovery, each rank reports a digest of its replicated state (step,
    #: parameters, optimizer) so tests can check that replicas agree. It reads the whole
    #: state on the recovery's path: off unless a check needs it.
    report_digest: bool = False
    #: Every N committed steps each rank writes a checkpoint (0: never); the fallback of
    #: a failure when a role has no data-parallel replica (DP=1).
    checkpoint_every: int = Field(default=0, ge=0)
    #: Shared directory of checkpoints (default: <run_dir>/checkpoints).
    checkpoint_dir: str = ""
    #: The step during which one live rank per role type records what it receives,
    #: for standbys' shadow iterations (0: never record).
    record_step: int = Field(default=1, ge=0)
    #: Record store directory (default: <run_dir>/records), when `record_store` is empty.
    record_dir: str = ""
    #: A NATS URL (nats://host:port, comma-separated for a cluster) to keep recordings in
    #: the job's JetStream object store TM_<job>_RECORDS instead of a directory: a
    #: standby then replays them with no storage shared with the live ranks.
    record_store: str = ""

    @field_validator("record_store")
    @classmethod
    def _record_store_url(cls, value: str) -> str:
        if value and not value.startswith(NATS_SCHEMES):
            raise ValueError(
                f"record_store {value!r}: a nats:// or tls:// URL, or empty for the "
                "directory record_dir"
            )
        return value

    @property
    def chunk_bytes(self) -> int:
        """`transfer_chunk_mib` in bytes, a whole number of 8-byte words (so chunks of an
        aligned tensor stay aligned)."""
        return max(8, int(self.transfer_chunk_mib * 1024 * 1024) // 8 * 8)


class ClusterConfig(BaseModel):
    """The machines of a job: names of the active ones (in layout order) and standbys."""

    model_config = ConfigDict(frozen=True)

    #: Active machines, one per (dp, pp) cell in `Layout.cells()` order; empty means
    #: m0, m1, ... .
    machines: list[str] = Field(default_factory=list)
    standbys: list[str] = Field(default_factory=lambda: ["s0"])
    #: Local cluster only: how long a drained machine stays in maintenance before its
    #: sidecar brings it back as a standby.
    maintenance_s: float = Field(default=5.0, ge=0)


class JobConfig(BaseModel):
    """A whole job, as read from its config file."""

    model_config = ConfigDict(frozen=True)

    job: str = "job"
    layout: Layout = Layout(tp=2, pp=2, dp=2)
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    cluster: ClusterConfig = ClusterConfig()

    @model_validator(mode="after")
    def _name_machines(self) -> JobConfig:
        names = self.cluster.machines or [f"m{i}" for i in range(self.layout.machines)]
        if len(names) != self.layout.machines:
            raise ValueError(
                f"cluster.machines names {len(names)} machines; the layout has "
                f"{self.layout.machines} (pp x dp)"
            )
        if len(set(names) | set(self.cluster.standbys)) != len(names) + len(self.cluster.standbys):
            raise ValueError("machine and standby names must be unique")
        if not self.cluster.machines:
            cluster = self.cluster.model_copy(update={"machines": names})
            object.__setattr__(self, "cluster", cluster)  # frozen model: fill the default once
        return self

    @model_validator(mode="after")
    def _check_divisibility(self) -> JobConfig:
        lay, m = self.layout, self.model
        if m.n_heads % lay.tp or (m.d_model * m.mlp_ratio) % lay.tp:
            raise ValueError("n_heads and the MLP width must divide by layout.tp")
        if m.d_model % m.n_heads:
            raise ValueError("d_model must divide by n_heads")
        if m.n_layers % lay.pp:
            raise ValueError("n_layers must divide by layout.pp")
        return self

    def with_updates(self, **sections: dict) -> JobConfig:
        """A copy with some fields of some sections replaced, e.g. train={"steps": 40}."""
        data = self.model_dump()
        for section, values in sections.items():
            data[section] = {**data[section], **values} if isinstance(values, dict) else values
        return JobConfig.model_validate(data)


def load_config(path: str | Path) -> JobConfig:
    """Reads a job config from YAML (.yaml/.yml) or JSON."""
    text = Path(path).read_text()
    data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    return JobConfig.model_validate(data or {})


def save_config(config: JobConfig, path: str | Path) -> Path:
    """Writes `config` as JSON (which YAML readers accept too)."""
    path = Path(path)
    path.write_text(json.dumps(config.model_dump(), indent=2))
    return path


def records_on_the_bus(config: JobConfig, nats_url: str) -> JobConfig:
    """`config` with its recordings in the job's object store on the bus at `nats_url`
    (what a sidecar hands its workers), unless the job names a record store or directory
    of its own: the bus is what every machine of a job shares, and a standby's host sees
    no other machine's files."""
    rt = config.runtime
    if rt.record_store or rt.record_dir or not nats_url.startswith(NATS_SCHEMES):
        return config
    return config.with_updates(runtime={"record_store": nats_url})
