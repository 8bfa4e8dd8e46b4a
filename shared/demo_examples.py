"""The jobs `trainmover demo` can run: the reference job, or one of examples/ (`--example`).

Each `DemoJob` says what the demo needs to run it: its job config, the worker entry
point the sidecars launch, the sidecars' extra flags, which machine each interruption
hits, and a one-line description. The demo itself (`trainmover.demo`) is the same for
all of them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from trainmover.runtime.config import JobConfig
from trainmover.runtime.launcher import REFERENCE_ENTRY


@dataclass(frozen=True)
class DemoJob:
    name: str
    description: str
    entry: str
    #: The machine drained, the machine killed, the machine slowed; "joiner:drain"
    #: names the drain's joiner.
    targets: tuple[str, str, str]
    layout: dict[str, int] = field(default_factory=dict)
    machines: list[str] = field(default_factory=list)
    #: Steps when `--steps` is not given: enough to still be training when the last
    #: interruption comes (a straggler is moved only once a drained machine is back;
    #: on a quiet host 400 steps of the reference job ended before that).
    default_steps: int = 600
    standbys: list[str] = field(default_factory=lambda: ["s0", "s1"])
    model: dict[str, int] = field(default_factory=dict)
    #: Runtime settings besides the demo's own (e.g. a checkpoint interval).
    runtime: dict[str, Any] = field(default_factory=dict)

    def config(self, steps: int) -> JobConfig:
        base = JobConfig(job="demo")
        sections: dict[str, dict] = {
            "train": {"steps": steps, "dump_steps": [steps]},
            "runtime": {"group_timeout_s": 60, **self.runtime},
            "cluster": {"standbys": self.standbys, "maintenance_s": 2.0},
        }
        if self.layout:
            sections["layout"] = self.layout
            sections["cluster"]["machines"] = self.machines
        if self.model:
            sections["model"] = self.model
        return base.with_updates(**sections)

    def sidecar_args(self) -> list[str]:
        return [] if self.entry == REFERENCE_ENTRY else ["--entry", self.entry]


REFERENCE = DemoJob(
    name="reference",
    description="TP2 x PP2 x DP2 on 4 machines + 2 standbys",
    entry=REFERENCE_ENTRY,
    targets=("m1", "m2", "m3"),
)

EXAMPLES: dict[str, DemoJob] = {
    "ddp": DemoJob(
        name="ddp",
        description="examples/ddp (a torchrun DDP script) at DP2 on 2 machines + 3 standbys",
        entry="trainmover.examples.ddp.train_trainmover",
        # Both machines of a DP2 job have moved once a drain and a failure are done, and
        # the planner does not move a machine that just joined for being slow: the
        # failure hits the drain's joiner, the straggler the other original machine.
        targets=("m0", "joiner:drain", "m1"),
        standbys=["s0", "s1", "s2"],
        layout={"tp": 1, "pp": 1, "dp": 2},
        machines=["m0", "m1"],
        # Its steps take milliseconds: thousands of them last as long as the interruptions.
        default_steps=3000,
        model={"d_model": 64},
    ),
    "llama": DemoJob(
        name="llama",
        description=(
            "examples/llama (a torchtitan-style FSDP2 + TP script) at TP2 x HSDP(2x2) on "
            "4 machines + 2 standbys"
        ),
        entry="trainmover.examples.llama.train_trainmover",
        # m2's shard is held by m0 too (the other replica): the kill recovers from it.
        targets=("m1", "m2", "m3"),
        layout={"tp": 2, "pp": 1, "dp": 4, "dp_shard": 2},
        machines=["m0", "m1", "m2", "m3"],
        default_steps=1500,
    ),
}


def pick(example: str | None) -> DemoJob:
    """The reference job for None, else the named example (a clear error otherwise)."""
    if example is None:
        return REFERENCE
    try:
        return EXAMPLES[example]
    except KeyError:
        raise ValueError(f"no example {example!r}: one of {', '.join(sorted(EXAMPLES))}") from None


#: An interruption of the demo: (cluster, machine) -> its migration row.
Interruption = Callable[[Any, str], Awaitable[Any]]


def scenarios(
    job: DemoJob, drain: Interruption, kill: Interruption, slow: Interruption
) -> list[Callable[[Any], Awaitable[Any]]]:
    """The demo's three interruptions of `job`, in order: a drain, a kill, a straggler;
    a target "joiner:drain" is resolved once the drain is done."""
    rows: list[Any] = []

    def target(name: str) -> str:
        return rows[0].joiner if name == "joiner:drain" else name

    async def drained(cluster: Any) -> Any:
        rows.append(await drain(cluster, target(job.targets[0])))
        return rows[0]

    return [
        drained,
        lambda cluster: kill(cluster, target(job.targets[1])),
        lambda cluster: slow(cluster, target(job.targets[2])),
    ]
