"""One machine's worker processes and the control channel to them (blocking, threaded).

The sidecar's asyncio side calls these methods through `asyncio.to_thread`; they speak
the runtime's control API (`trainmover.runtime.control`) to the local ranks and wait for
their events with deadlines, failing fast when a worker dies.

Roles come from the cluster state: a machine that the planner lists as active gets its
cell's roles and current-generation groups in the answer to its workers' hello; any
other machine's workers start as standbys and get a role only from a plan (as joiners).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from trainmover.messages import ClusterState, WorkerState, WorkerStatus
from trainmover.runtime import control as c
from trainmover.runtime.config import JobConfig, save_config
from trainmover.runtime.launcher import ControlServer, spawn_worker
from trainmover.runtime.layout import MachineRole, Role
from trainmover.runtime.plan import Plan, RankRef, group_specs
from trainmover.runtime.supervisor import RankTracker, stop_processes


class MachineWorkers:
    """The local ranks of one machine: spawn, answer hello, relay commands, track events."""

    def __init__(
        self,
        machine: str,
        config: JobConfig,
        run_dir: Path,
        store_address: str,
        state: Callable[[], ClusterState | None],
        entry: str,
        timeout_s: float = 120.0,
    ) -> None:
        self.machine = machine
        self.config = config
        self.run_dir = run_dir
        self.store_address = store_address
        self.entry = entry
        self.timeout_s = timeout_s
        self._state = state
        self.tracker = RankTracker(run_dir)
        self._config_path = save_config(config, run_dir / f"job-{machine}.json")
        self.control = ControlServer(self._welcome, self.tracker.on_event)
        self.cell: MachineRole | None = None
        self._lock = threading.Lock()
        self.tracker.listeners.append(self._on_event)

    @property
    def refs(self) -> list[RankRef]:
        return [
            RankRef(machine=self.machine, local_rank=i)
            for i in range(self.config.layout.ranks_per_machine)
        ]

    # --- processes -------------------------------------------------------------------

    def launch(self) -> None:
        """Starts this machine's worker processes (again, after a maintenance)."""
        for ref in self.refs:
            proc = spawn_worker(
                ref, self.entry, self.control.address, self._config_path, self.run_dir
            )
            self.tracker.add_process(ref, proc)

    def wait_connected(self, timeout_s: float | None = None) -> None:
        refs = set(self.refs)
        self.tracker.wait(
            lambda: refs <= self.control.connected(),
            timeout_s or self.timeout_s,
            f"hello from {self.machine}",
            refs,
        )

    def running(self) -> bool:
        return any(p.poll() is None for p in self.tracker.procs.values())

    def stop(self) -> None:
        """Asks the workers to finish at the next step boundary, then makes sure they do."""
        for ref in self.tracker.live():
            if ref in self.control.connected():
                try:
                    self.control.request(ref, c.Stop(), timeout_s=2)
                except Exception:  # noqa: S110 - it is being stopped either way
                    pass
        stop_processes(self.tracker.procs.values())

    def close(self) -> None:
        self.stop()
        self.control.close()

    def worker_status(self) -> list[WorkerStatus]:
        out = []
        connected = self.control.connected()
        for ref in self.refs:
            proc = self.tracker.procs.get(ref)
            if proc is None:
                continue
            code = proc.poll()
            state: WorkerState
            if code is not None:
                state, exit_code = "exited", code
            elif ref not in connected:
                state, exit_code = "starting", None
            else:
                state, exit_code = ("running" if self.cell is not None else "standby"), None
            out.append(
                WorkerStatus(
                    local_rank=ref.local_rank,
                    pid=proc.pid,
                    state=state,
                    exit_code=exit_code,
                    step=self.tracker.last_step.get(ref),
                )
            )
        return out

    # --- control-plane answers ---------------------------------------------------------

    def _welcome(self, hello: c.Hello) -> c.Welcome:
        state = self._state()
        me = RankRef(machine=hello.machine, local_rank=hello.local_rank)
        mine = state.machines.get(self.machine) if state else None
        role, groups = None, []
        if (
            state is not None
            and mine is not None
            and mine.cell is not None
            and mine.status in ("active", "leaving")
        ):
            assignment = {
                n: m.cell
                for n, m in state.machines.items()
                if m.cell is not None and m.status in ("active", "leaving")
            }
            generations = {n: state.generations.get(n, 0) for n in self.config.layout.all_groups()}
            role = Role(dp=mine.cell.dp, pp=mine.cell.pp, tp=hello.local_rank)
            groups = [
                s
                for s in group_specs(self.config.layout, assignment, generations)
                if s.group_rank(me) is not None
            ]
            with self._lock:
                self.cell = mine.cell
        return c.Welcome(
            job=self.config.job,
            role=role,
            groups=groups,
            limit=self.config.train.steps,
            store=self.store_address,
        )

    def _on_event(self, ref: RankRef, msg: c.Message) -> None:
        if isinstance(msg, c.Switched) and msg.part == "leaver":
            with self._lock:
                self.cell = None

    # --- migration commands -------------------------------------------------------------

    def affected(self, plan: Plan) -> list[RankRef]:
        return [r for r in self.refs if plan.specs_for(r)]

    def prepare(self, plan: Plan, timeout_s: float) -> dict[str, object]:
        """Phase 1 on this machine's ranks of the plan; returns once all are ready."""
        self.wait_connected(timeout_s)  # a plan can come while the workers still start
        refs = self.affected(plan)
        if self.cell is not None:
            # An active machine's ranks take a plan only once training runs: their first
            # groups are built and installed at their first step.
            self.tracker.wait(
                lambda: all(self.tracker.step_of(r) >= 1 for r in refs),
                timeout_s,
                f"the first step on {self.machine}",
                refs,
            )
        acks = {r: self.control.request(r, c.Prepare(plan=plan), timeout_s) for r in refs}

        def all_ready() -> bool:
            failed = self.tracker.failed.get(plan.plan_id)
            if failed:
                raise RuntimeError(
                    f"plan {plan.plan_id} failed on {self.machine}: "
                    + "; ".join(f.error for f in failed.values())
                )
            return all(r in self.tracker.ready[plan.plan_id] for r in refs)

        self.tracker.wait(all_ready, timeout_s, f"ready of {plan.plan_id}", refs)
        ready = self.tracker.ready[plan.plan_id]
        return {
            "ranks": len(refs),
            "build_s": max((ready[r].build_s for r in refs), default=0.0),
            "steps_during_build": min((ready[r].steps_during_build for r in refs), default=0),
            "step": max((a.step for a in acks.values() if isinstance(a, c.PrepareAck)), default=0),
        }

    def current_step(self) -> int:
        return max((self.tracker.step_of(r) for r in self.refs), default=0)

    def commit(self, plan: Plan, step: int, timeout_s: float) -> dict[str, object]:
        """Phase 2: this machine's ranks switch at the boundary after `step`."""
        acks = {
            r: self.control.request(r, c.Commit(plan_id=plan.plan_id, step=step), timeout_s)
            for r in self.affected(plan)
        }
        refused = {
            str(r): a.reason
            for r, a in acks.items()
            if isinstance(a, c.CommitAck) and not a.accepted
        }
        if refused:
            raise RuntimeError(f"commit({step}) refused on {self.machine}: {refused}")
        return {"accepted": len(acks)}

    def wait_switched(self, plan: Plan, timeout_s: float) -> dict[str, object]:
        """Until this machine's ranks switched (and a leaver's workers exited)."""
        refs = self.affected(plan)
        self.tracker.wait(
            lambda: all(r in self.tracker.switched[plan.plan_id] for r in refs),
            timeout_s,
            f"switch of {plan.plan_id}",
            refs,
        )
        switched = self.tracker.switched[plan.plan_id]
        return {
            "parts": sorted({switched[r].part for r in refs}),
            "rebuilt": sorted({g for r in refs for g in switched[r].rebuilt}),
            "t_start": min(switched[r].t_start for r in refs),
            "t_end": max(switched[r].t_end for r in refs),
            "transfer_bytes": sum(switched[r].transfer_bytes for r in refs),
            "transfer_s": max(switched[r].transfer_s for r in refs),
        }

    def wait_exited(self, timeout_s: float) -> None:
        """Until every worker process of this machine is gone (a leaver after its switch:
        interpreter teardown with torch takes seconds, off the critical path)."""
        self.tracker.wait(
            lambda: not self.running(), timeout_s, f"{self.machine}'s workers to exit"
        )

    def step_times(self, step: int, timeout_s: float) -> dict[str, object]:
        """Waits until every live rank finished `step`; returns end times and step lengths."""
        refs = self.tracker.live()
        self.tracker.wait(
            lambda: all(self.tracker.step_of(r) >= step for r in refs),
            timeout_s,
            f"step {step} on {self.machine}",
            refs,
        )
        ends = self.tracker.step_ends(step, refs)
        durations = sorted(
            e.seconds
            for s in range(max(1, step - 20), step)
            for e in self.tracker.steps.get(s, {}).values()
        )
        return {
            "t_end": max(ends.values(), default=0.0),
            "median_step_s": durations[len(durations) // 2] if durations else 0.0,
        }
