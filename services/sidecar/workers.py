"""One machine's worker processes and the control channel to them (blocking, threaded).

The sidecar's asyncio side calls these methods through `asyncio.to_thread`; they speak
the runtime's control API (`trainmover.runtime.control`) to the local ranks and wait for
their events with deadlines, failing fast when a worker dies.

Roles come from the cluster state: a machine that the planner lists as active gets its
cell's roles and current-generation groups in the answer to its workers' hello; any
other machine's workers start as standbys and get a role only from a plan (as joiners).

`handle` runs one of the executor's commands on these ranks: the sidecar calls it for
every op that needs only the workers, and the in-process harness (`trainmover.localjob`)
for all of them, with one `WorkerChannel` shared by every machine of its job.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainmover.messages import ClusterState, Command, Plan, WorkerState, WorkerStatus
from trainmover.planwire import plan_of
from trainmover.runtime import control as c
from trainmover.runtime import controlconn
from trainmover.runtime.config import JobConfig, save_config
from trainmover.runtime.launcher import ControlServer, WorkerProcess, WorkerStarter
from trainmover.runtime.layout import MachineRole, Role
from trainmover.runtime.plan import RankRef, group_specs
from trainmover.runtime.supervisor import RankCommands, RankTracker, stop_processes
from trainmover.services.sidecar import procstat

Welcome = Callable[[c.Hello], c.Welcome]

WORKER_OPS = frozenset(
    {"status", "steps", "slow", "block", "hold", "finish", "prepare", "commit", "recover",
     "transfer"}
)  # fmt: skip
"""The ops `MachineWorkers.handle` runs: those that need nothing but the workers."""


@dataclass
class WorkerChannel:
    """The supervising end of some ranks' control connections: their events, the
    commands to them, and the fork server that starts them."""

    tracker: RankTracker
    control: ControlServer
    commands: RankCommands
    starter: WorkerStarter

    @classmethod
    def open(cls, run_dir: Path, name: str, welcome: Welcome, timeout_s: float) -> WorkerChannel:
        tracker = RankTracker(run_dir)
        control = ControlServer(welcome, tracker.on_event, on_disconnect=tracker.on_disconnect)
        return cls(tracker, control, RankCommands(control, tracker, timeout_s),
                   WorkerStarter(run_dir, name))  # fmt: skip

    def close(self) -> None:
        self.starter.close()
        self.control.close()


class MachineWorkers:
    """The local ranks of one machine: spawn, answer hello, relay commands, track events.

    By default the machine has a channel of its own (a sidecar); given `channel`, it
    shares one with other machines (the in-process harness), and only ever looks at its
    own ranks in it. `limit` is the last step a rank welcomed now may train (default:
    the job's last)."""

    def __init__(
        self,
        machine: str,
        config: JobConfig,
        run_dir: Path,
        store_address: str,
        state: Callable[[], ClusterState | None],
        entry: str,
        timeout_s: float = 120.0,
        channel: WorkerChannel | None = None,
        limit: Callable[[], int] | None = None,
    ) -> None:
        self.machine = machine
        self.config = config
        self.run_dir = run_dir
        self.store_address = store_address
        self.entry = entry
        self.timeout_s = timeout_s
        self._state = state
        self._limit = limit or (lambda: config.train.steps)
        self._own_channel = channel is None
        self.channel = channel or WorkerChannel.open(run_dir, machine, self.welcome, timeout_s)
        self.tracker = self.channel.tracker
        self.starter = self.channel.starter
        self.control = self.channel.control
        self.commands = self.channel.commands
        self._config_path = save_config(config, run_dir / f"job-{machine}.json")
        self._recovered: dict[str, list[RankRef]] = {}
        self.cell: MachineRole | None = None
        self._as_standby = False
        self._lock = threading.Lock()
        #: Notified when a launch's local rank 0 names its machine's vote store.
        self._named = threading.Condition(self._lock)
        self.tracker.listeners.append(self._on_event)
        #: This launch of the machine's workers (a relaunch is another).
        self.launch_id = uuid.uuid4().hex
        #: (launch, address) of the vote store the launch's local rank 0 named in its hello.
        self._machine_store: tuple[str, str] | None = None

    @property
    def refs(self) -> list[RankRef]:
        return [
            RankRef(machine=self.machine, local_rank=i)
            for i in range(self.config.layout.ranks_per_machine)
        ]

    @property
    def machine_store(self) -> str:
        """The vote store this launch's local rank 0 named ("" before its hello, or where
        each rank votes in the job's store)."""
        with self._lock:
            return self._named_by(self.launch_id) or ""

    def _named_by(self, launch: str) -> str | None:
        """The vote store local rank 0 of `launch` named (lock held); None before its hello."""
        named = self._machine_store
        return named[1] if named is not None and named[0] == launch else None

    def live(self) -> list[RankRef]:
        """This machine's ranks whose workers run and have not said goodbye."""
        return [r for r in self.tracker.live() if r.machine == self.machine]

    def _procs(self) -> list[WorkerProcess]:
        return [p for r, p in list(self.tracker.procs.items()) if r.machine == self.machine]

    # --- processes -------------------------------------------------------------------

    def launch(self, as_standby: bool = False) -> None:
        """Starts this machine's worker processes (again, after a maintenance or a
        fence: `as_standby`). New workers hold no role until their welcome gives them
        one; workers launched `as_standby` are given none, whatever the cluster state
        they are welcomed by (it may not yet say that this machine lost its role)."""
        with self._lock:
            self.cell = None
            self._as_standby = as_standby
            self.launch_id = uuid.uuid4().hex
        for ref in self.refs:
            proc = self.starter.spawn(
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
        return any(p.poll() is None for p in self._procs())

    def stop(self) -> None:
        """Asks the workers to finish at the next step boundary, then makes sure they do."""
        for ref in self.live():
            if ref in self.control.connected():
                try:
                    self.control.request(ref, c.Stop(), timeout_s=2)
                except Exception:  # noqa: S110 - it is being stopped either way
                    pass
        stop_processes(self._procs())

    def kill(self) -> None:
        """SIGKILLs every worker process at once (a fence: no step boundary is waited
        for, and a hung or stopped process dies too), then reaps them."""
        procs = [p for p in self._procs() if p.poll() is None]
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()

    def close(self) -> None:
        self.stop()
        if self._own_channel:
            self.channel.close()

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
            cpu = procstat.sample(proc.pid) if code is None else None
            out.append(
                WorkerStatus(
                    local_rank=ref.local_rank,
                    pid=proc.pid,
                    state=state,
                    exit_code=exit_code,
                    step=self.tracker.last_step.get(ref),
                    cpu_s=cpu.cpu_s if cpu else None,
                    cpu_wait_s=cpu.cpu_wait_s if cpu else None,
                    runnable_threads=cpu.runnable_threads if cpu else None,
                )
            )
        return out

    # --- control-plane answers ---------------------------------------------------------

    def welcome(self, hello: c.Hello) -> c.Welcome:
        state = self._state()
        me = RankRef(machine=hello.machine, local_rank=hello.local_rank)
        mine = state.machines.get(self.machine) if state else None
        role, groups = None, []
        with self._lock:
            as_standby = self._as_standby
        if (
            not as_standby
            and state is not None
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
        # A standby is not told the rendezvous store: its shadow iterations have no path
        # to the live job; a joiner learns it from its plan's prepare or recover.
        launch, machine_store = self._machine_store_for(hello)
        return c.Welcome(
            job=self.config.job,
            role=role,
            groups=groups,
            limit=self._limit(),
            store=self.store_address if role is not None else "",
            launch=launch,
            machine_store=machine_store,
        )

    def _machine_store_for(self, hello: c.Hello) -> tuple[str, str]:
        """The launch a rank saying `hello` belongs to, and its machine's vote store: the
        one local rank 0 names in its own hello, which every other rank's welcome waits
        for (they start together; a welcome without it would leave the rank no vote)."""
        with self._named:
            launch = self.launch_id
            if hello.local_rank == 0:
                self._machine_store = (launch, hello.machine_store)
                self._named.notify_all()
                return launch, hello.machine_store
            self._named.wait_for(lambda: self._named_by(launch) is not None, self.timeout_s)
            named = self._named_by(launch)
            if named is None:
                raise RuntimeError(
                    f"local rank 0 of {self.machine} said no hello within {self.timeout_s:.0f} s:"
                    f" no vote store for local rank {hello.local_rank} of launch {launch}"
                )
            return launch, named

    def _on_event(self, ref: RankRef, msg: c.Message) -> None:
        if ref.machine == self.machine and isinstance(msg, c.Switched) and msg.part == "leaver":
            with self._lock:
                self.cell = None

    # --- the executor's commands ----------------------------------------------------------

    def handle(self, command: Command, timeout_s: float) -> dict[str, object]:
        """Runs `command` (an op of the workers alone; see `WORKER_OPS`) on this
        machine's ranks and returns its result."""
        op, args = command.op, command.args
        if op == "status":
            return {"step": self.current_step()}
        if op == "steps":
            return self.step_times(int(args["step"]), timeout_s)
        if op == "slow":  # fault injection: this machine becomes a straggler
            return self.slow(float(args.get("extra_s", 0.0)))
        if op == "block":  # fault injection: one worker deadlocks in a collective
            return self.block(str(args["group"]), int(args.get("local_rank", 0)))
        if op == "hold":  # train up to this step and wait there
            return self.hold_at(int(args["step"]))
        if op == "finish":  # the job ends after this step on every machine
            return self.finish_at(int(args["step"]), timeout_s)
        plan = plan_of(command)
        if op == "prepare":
            return self.prepare(plan, timeout_s)
        if op == "commit":
            return self.commit(plan, int(args["step"]), timeout_s)
        if op == "recover":
            return self.recover(plan, timeout_s)
        if op == "transfer":  # the switch: phase 2, state transfer included
            return self.wait_switched(plan, timeout_s)
        raise ValueError(f"unsupported op {op!r}")

    # --- migration commands -------------------------------------------------------------

    def affected(self, plan: Plan) -> list[RankRef]:
        return [r for r in self.refs if plan.specs_for(r)]

    def refuse_if_exited(self, plan: Plan) -> None:
        """A plan for ranks whose workers have ended (the job finished, or they left) is
        refused at once, naming them: none of them will ever connect to take it."""
        gone = self.tracker.ended(self.refs)
        if gone:
            ended = ", ".join(f"{r} {e.reason} at step {e.step}" for r, e in gone.items())
            raise RuntimeError(f"plan {plan.plan_id}: no live worker on {self.machine} ({ended})")

    def prepare(self, plan: Plan, timeout_s: float) -> dict[str, object]:
        """Phase 1 on this machine's ranks of the plan; returns once all are ready."""
        self.refuse_if_exited(plan)
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
        acks = self.commands.prepare(refs, plan, store=self.store_address)
        ready = self.commands.wait_ready(refs, plan, timeout_s)
        return {
            "ranks": len(refs),
            "build_s": max((ready[r].build_s for r in refs), default=0.0),
            "steps_during_build": min((ready[r].steps_during_build for r in refs), default=0),
            # Where the ranks are now, ready (the executor picks its switch step from it).
            "step": max(
                self.current_step(),
                *(a.step for a in acks.values() if isinstance(a, c.PrepareAck)),
                0,
            ),
        }

    def current_step(self) -> int:
        return max((self.tracker.step_of(r) for r in self.refs), default=0)

    def commit(self, plan: Plan, step: int, timeout_s: float) -> dict[str, object]:
        """Phase 2: this machine's ranks switch at the boundary after `step`. Each rank's
        refusal is answered with its reason (the executor judges the round, see
        `trainmover.services.executor.switch`), with the furthest step passed here."""
        acks = self.commands.offer_commit(self.affected(plan), plan, step)
        return {
            "accepted": sum(a.accepted for a in acks.values()),
            "refused": {str(r): a.reason for r, a in acks.items() if not a.accepted},
            "passed": max((a.passed for a in acks.values()), default=0),
        }

    def recover(self, plan: Plan, timeout_s: float) -> dict[str, object]:
        """The unplanned path: every live rank here (a survivor, or the joiner) aborts its
        step and recovers in the plan's epoch; returns once they sent `recover_ack`."""
        self.refuse_if_exited(plan)
        self.wait_connected(timeout_s)
        refs = self.live()
        self._recovered[plan.plan_id] = refs
        acks = self.commands.recover(refs, plan, store=self.store_address)
        return {
            "ranks": len(refs),
            "committed": max((a.committed for a in acks.values()), default=0),
        }

    def warm(self, role_types: list[str], timeout_s: float) -> dict[str, object]:
        """Shadow iterations for each role type on this standby's ranks: the machine is
        warm for the role types every rank warmed for; `errors` names each rank whose
        warm-up failed."""
        self.wait_connected(timeout_s)
        warmed = self.commands.warm(self.refs, role_types, timeout_s=timeout_s)
        first = next(iter(warmed.values()))
        return {
            "role_types": [
                t for t in first.role_types if all(t in w.role_types for w in warmed.values())
            ],
            "errors": [
                f"local rank {r.local_rank}: {w.error}" for r, w in warmed.items() if w.error
            ],
            "iteration_s": first.iteration_s,
            "replayed": sum(w.replayed for w in warmed.values()),
            "synthesized": sum(w.synthesized for w in warmed.values()),
            "kept_bytes": sum(w.kept_bytes for w in warmed.values()),
            "rss_bytes": sum(w.rss_bytes for w in warmed.values()),
            "store_known": any(w.store_known for w in warmed.values()),
        }

    def wait_switched(self, plan: Plan, timeout_s: float) -> dict[str, object]:
        """Until this machine's ranks of the plan switched (planned: the ranks in the
        plan; a recovery: every rank it was sent to)."""
        refs = self._recovered.get(plan.plan_id) or self.affected(plan)
        switched = self.commands.wait_switched(refs, plan, timeout_s)
        return {
            "parts": sorted({e.part for e in switched.values()}),
            "rebuilt": sorted({g for e in switched.values() for g in e.rebuilt}),
            "repaired": sorted({g for e in switched.values() for g in e.repaired}),
            "step": max((e.step for e in switched.values()), default=0),
            "t_start": min((e.t_start for e in switched.values()), default=0.0),
            "t_end": max((e.t_end for e in switched.values()), default=0.0),
            "transfer_bytes": sum(e.transfer_bytes for e in switched.values()),
            "transfer_s": max((e.transfer_s for e in switched.values()), default=0.0),
            "source": sorted({e.source for e in switched.values()}),
        }

    def slow(self, extra_s: float) -> dict[str, object]:
        """Fault injection: adds `extra_s` of compute to every step of this machine."""
        refs = self.live()
        for ref in refs:
            self.control.request(ref, c.Slow(extra_s=extra_s), self.timeout_s)
        return {"ranks": len(refs), "extra_s": extra_s}

    def block(self, group: str, local_rank: int) -> dict[str, object]:
        """Fault injection: one worker of this machine deadlocks at its next vote, in an
        extra collective of `group` that its peers never join."""
        refs = [r for r in self.live() if r.local_rank == local_rank]
        if not refs:
            raise ValueError(f"{self.machine} has no live worker of local rank {local_rank}")
        for ref in refs:
            self.control.request(ref, c.Block(group=group), self.timeout_s)
        return {"ranks": len(refs), "group": group}

    def hold_at(self, step: int, last: bool = False) -> dict[str, object]:
        """Lets this machine's ranks train up to `step` and hold there (a later, higher
        step releases them). With `last`, the job ends there instead: they finish after
        `step` (saving their state if the config dumps the last step). Refused, naming
        the ranks, when a rank here has already left the boundary after `step`. (A
        standby's workers take the step too; they train none until they join.)"""
        refs = self.live()
        past = {}
        for ref in refs:
            try:
                self.control.request(ref, c.Advance(limit=step, last=last), self.timeout_s)
            except controlconn.RemoteError as err:
                past[str(ref)] = str(err)
        if past:
            raise ValueError(f"hold at step {step}: ranks already past it: {past}")
        return {"ranks": len(refs), "step": step}

    def finish_at(self, step: int, timeout_s: float) -> dict[str, object]:
        """Ends training on this machine after `step`, ahead of the job's last step, and
        returns once its workers exited. Every active machine of the job must get the
        same step, each held at or before it first (`hold_at`): a rank that committed it
        then needs no peer any more, since every rank voted for it."""
        result = self.hold_at(step, last=True)
        self.wait_exited(timeout_s)
        return result

    def wait_exited(self, timeout_s: float) -> None:
        """Until every worker process of this machine is gone (a leaver after its switch:
        interpreter teardown with torch takes seconds, off the critical path)."""
        self.tracker.wait(
            lambda: not self.running(), timeout_s, f"{self.machine}'s workers to exit"
        )

    def step_times(self, step: int, timeout_s: float) -> dict[str, object]:
        """Waits until every live rank finished `step`; returns end times and step lengths."""
        refs = self.live()
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
