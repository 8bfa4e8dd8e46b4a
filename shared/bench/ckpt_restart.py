"""The checkpoint-restart baseline: the same job launched by ``torchrun``, restarted by
torch.distributed.elastic after a SIGKILL (unplanned) or saved and relaunched (planned).
The job is the reference job (`trainmover.bench.ckpt_train`) or an example's torchrun
script (`trainmover.bench.ddp_ckpt_train`): both take the same options and write the same
events.

`TorchrunJob` starts one torchrun agent per machine (c10d rendezvous on loopback,
``--nproc-per-node`` = TP, ``--max-restarts``), each in its own session so the harness
can end exactly the processes it started. Workers run `trainmover.bench.ckpt_train` and
report events in run_dir/events; all times here come from those events.

Downtime:
- failure: SIGKILL of the worker serving role (dp 0, pp 0, tp 0) in the middle of the
  step halfway between two checkpoints; downtime = kill -> first step done after the
  restart + the steps recomputed since the last checkpoint x the normal step (the issue's
  definition); `end_to_end_s` is the glossary's downtime (end of the last step before the kill ->
  end of the same step number + 1 after recovery, minus a normal step).
- planned (save-and-restart): every rank checkpoints at step S and exits, a new torchrun
  is launched at once and resumes; downtime = end of S -> end of S + 1 minus a normal step.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from trainmover.bench.ckpt_train import latest_complete
from trainmover.bench.role import read_events
from trainmover.bench.settings import harness_timeout_s
from trainmover.runtime.config import JobConfig, save_config

T = TypeVar("T")
VICTIM_ROLE = "d0p0t0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: How far ahead of the furthest rank a save-and-restart's stop step is put, in seconds.
STOP_AHEAD_S = 1.0


def stop_ahead(ends: dict[int, float]) -> int:
    """The step a save-and-restart stops after: ahead of every rank, so that all stop at
    the same boundary, by a second's worth of steps at least (a tiny job's ranks pass a
    nearer one while the stop is being written, and then each stops at its own)."""
    period = normal_period(ends, max(ends))
    return max(ends) + max(3, math.ceil(STOP_AHEAD_S / max(period, 1e-3)))


def step_ends(events: list[dict[str, Any]], world: int, after: float = 0.0) -> dict[int, float]:
    """step -> when the last rank finished it, counting each rank's first report of the
    step after `after` (a restart recomputes steps); only steps every rank reported."""
    first: dict[int, dict[int, float]] = {}
    for e in events:
        if e["event"] == "step" and e["t"] > after:
            first.setdefault(e["step"], {}).setdefault(e["rank"], e["t"])
    return {s: max(by_rank.values()) for s, by_rank in first.items() if len(by_rank) == world}


def normal_period(ends: dict[int, float], last: int, count: int = 8) -> float:
    """Median step period over the `count` steps up to `last`."""
    periods = [
        ends[s] - ends[s - 1]
        for s in range(last - count + 1, last + 1)
        if s - 1 in ends and s in ends
    ]
    return statistics.median(periods)


class TorchrunJob:
    """The baseline job: torchrun agents (one per machine) and their workers."""

    def __init__(
        self,
        config: JobConfig,
        run_dir: Path,
        every: int,
        max_restarts: int = 3,
        script: str = "trainmover.bench.ckpt_train",
    ):
        self.config, self.every, self.max_restarts = config, every, max_restarts
        #: The training script's module (`ckpt_train`'s command line and events).
        self.script = script
        self.run_dir = Path(run_dir)
        (self.run_dir / "events").mkdir(parents=True, exist_ok=True)
        self.config_path = save_config(config, self.run_dir / "job.json")
        self.world = config.layout.tp * config.layout.machines
        self.launches = 0
        self.agents: list[subprocess.Popen[bytes]] = []
        self.timeout_s = harness_timeout_s(config)

    # -- processes ---------------------------------------------------------------------

    def launch(self) -> float:
        """Starts a fresh torchrun job (resuming from the newest complete checkpoint)."""
        (self.run_dir / "stop_at").unlink(missing_ok=True)
        self.launches += 1
        lay = self.config.layout
        port = free_port()
        started = time.time()
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            # pytorch/pytorch#135712: with the shared rendezvous store, restarted workers
            # read the dead workers' gloo addresses ("connectFullMesh ... Connection
            # refused"). A per-restart key prefix is not enough with several agents: only
            # the agent whose worker died counts a restart in TORCHELASTIC_RESTART_COUNT.
            # Unshared, rank 0 hosts a fresh store for every rendezvous round.
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        }
        self.agents = []
        for node in range(lay.machines):
            log = (self.run_dir / f"torchrun-l{self.launches}-n{node}.log").open("ab")
            cmd = [
                sys.executable, "-m", "torch.distributed.run",
                f"--nnodes={lay.machines}", f"--nproc-per-node={lay.tp}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id=bench-{self.launches}", "--local-addr=127.0.0.1",
                f"--max-restarts={self.max_restarts}", "--monitor-interval=0.1",
                "-m", self.script,
                "--config", str(self.config_path), "--run-dir", str(self.run_dir),
                "--every", str(self.every), "--launch", str(self.launches),
            ]  # fmt: skip
            # A session of its own: close() ends this agent and its workers by group id,
            # never anyone else's processes.
            self.agents.append(
                subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
            )  # fmt: skip
            log.close()
        return started

    def close(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for agent in self.agents:
                if agent.poll() is None:
                    try:
                        os.killpg(agent.pid, sig)
                    except ProcessLookupError:
                        pass
            deadline = time.time() + 10
            while time.time() < deadline and any(a.poll() is None for a in self.agents):
                time.sleep(0.1)

    def __enter__(self) -> TorchrunJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- observation -------------------------------------------------------------------

    def events(self) -> list[dict[str, Any]]:
        return read_events(self.run_dir / "events")

    def ends(self, after: float = 0.0) -> dict[int, float]:
        return step_ends(self.events(), self.world, after)

    def wait(
        self, predicate: Callable[[], T | None], what: str, agents_may_exit: bool = False
    ) -> T:
        deadline = time.time() + self.timeout_s
        while True:
            result = predicate()
            if result:
                return result
            if not agents_may_exit and any(a.poll() is not None for a in self.agents):
                raise RuntimeError(f"torchrun exited while waiting for {what}: {self._log_tail()}")
            if time.time() > deadline:
                raise TimeoutError(f"timed out waiting for {what}: {self._log_tail()}")
            time.sleep(0.02)

    def _log_tail(self) -> str:
        logs = sorted(self.run_dir.glob(f"torchrun-l{self.launches}-n*.log"))
        return logs[0].read_text(errors="replace")[-1500:] if logs else ""

    def wait_step(self, step: int, after: float = 0.0) -> dict[int, float]:
        def reached() -> dict[int, float] | None:
            ends = self.ends(after)
            return ends if step in ends else None

        return self.wait(reached, f"step {step}")

    def current_step(self, after: float = 0.0) -> int:
        return max(self.ends(after), default=0)

    # -- the measured events -----------------------------------------------------------

    def failure(self, warm_steps: int) -> dict[str, Any]:
        """SIGKILL one worker halfway between two checkpoints and time the recovery."""
        half = self.every // 2
        now = self.current_step()
        target = now + warm_steps
        target += (half - target) % self.every  # kill after a step at ckpt + every/2
        ends = self.wait_step(target)
        normal = normal_period(ends, target)
        time.sleep(normal / 2)  # in the middle of the next step
        victim = max(
            (e for e in self.events() if e["event"] == "start" and e["role"] == VICTIM_ROLE),
            key=lambda e: e["t"],
        )
        t_kill = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        before = {s: t for s, t in self.ends().items() if t <= t_kill}
        last_done = max(before)
        ckpt = latest_complete(self.run_dir / "ckpt", self.world)
        after = self.wait_step(last_done + 1, after=t_kill)
        events = [e for e in self.events() if e["t"] > t_kill]
        respawned = min(e["t"] for e in events if e["event"] == "start")
        loaded = max(e["t"] for e in events if e["event"] == "loaded")
        first = after[min(after)]
        recompute = last_done - ckpt
        return {
            "kill_step": last_done + 1,
            "checkpoint_step": ckpt,
            "recomputed_steps": recompute,
            "normal_step_s": normal,
            "restart_s": first - t_kill,
            "downtime_s": first - t_kill + recompute * normal,
            "end_to_end_s": after[last_done + 1] - before[last_done] - normal,
            "phases_s": {
                "detect_and_respawn": respawned - t_kill,
                "rendezvous_groups_load": loaded - respawned,
                "first_step": first - loaded,
                "recompute": recompute * normal,
            },
        }

    def planned(self, warm_steps: int) -> dict[str, Any]:
        """Save-and-restart: checkpoint at step S, exit, relaunch at once, resume."""
        ends = self.wait_step(self.current_step() + warm_steps)
        stop = stop_ahead(ends)
        (self.run_dir / "stop_at").write_text(str(stop))
        self.wait(lambda: all(a.poll() is not None for a in self.agents), "exit", True)
        exited = time.time()
        if any(a.returncode for a in self.agents):
            raise RuntimeError(f"save-and-exit failed: {self._log_tail()}")
        ends = self.ends()
        normal = normal_period(ends, stop)
        saved = max(e["t"] for e in self.events() if e["event"] == "saved" and e["step"] == stop)
        launched = self.launch()
        after = self.wait_step(stop + 1, after=launched)
        events = [e for e in self.events() if e["t"] > launched]
        started = min(e["t"] for e in events if e["event"] == "start")
        loaded = max(e["t"] for e in events if e["event"] == "loaded")
        return {
            "stop_step": stop,
            "normal_step_s": normal,
            "downtime_s": after[stop + 1] - ends[stop] - normal,
            "phases_s": {
                "save": saved - ends[stop],
                "exit": exited - saved,
                "launch_to_workers": started - launched,
                "rendezvous_groups_load": loaded - started,
                "first_step": after[stop + 1] - loaded,
            },
        }
