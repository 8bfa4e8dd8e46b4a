"""Processes that host a job's simulated machines (`simmachine`), hundreds or thousands
each, and the benchmark's handle on them.

    python -m trainmover.bench.simhost --nats-url URL --job-config F --index I --hosts N \\
        --job-start T [--timing JSON]

Host I of N takes every N-th machine of the job config (machines, then standbys) from
the I-th, connects to the bus with one connection per `PER_CONNECTION` machines (a
real sidecar has its own; one connection for thousands would make its socket, not the
services, what falls behind), and starts them. Like every sidecar it follows the job's
cluster state and fences its machines that the state fences, but with one follower for
all of its machines, not one each, that reads only the newest state. It prints one JSON
line `{"ready": ...}` on stdout once every machine serves, then answers JSON lines on
stdin, one reply line each: `silence` / `revive` a machine, `records` (the commands
answered for some plans), `quit`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from nats.js.errors import BucketNotFoundError

from trainmover import bus, logs
from trainmover.bench.control_plane_probe import newest_states
from trainmover.bench.simmachine import CommandRecord, JobClock, PlanCache, SimMachine, SimTiming
from trainmover.logs import get_logger
from trainmover.runtime.config import JobConfig, load_config
from trainmover.services.executor.fencing import fenced_in
from trainmover.tasks import cancel_and_wait

log = get_logger("simhost")

#: Simulated machines per bus connection of a host.
PER_CONNECTION = 256
#: Longest reply line a host may write (the records of a recovery of thousands of machines).
REPLY_LIMIT = 256 * 2**20


def hosted(config: JobConfig, index: int, hosts: int) -> list[str]:
    """The machines host `index` of `hosts` simulates."""
    return [*config.cluster.machines, *config.cluster.standbys][index::hosts]


class Host:
    """The machines of one host process, their connections and their records."""

    def __init__(self, url: str, config: JobConfig, names: list[str], clock: JobClock,
                 timing: SimTiming) -> None:  # fmt: skip
        self.url, self.config, self.names, self.clock, self.timing = (
            url, config, names, clock, timing
        )  # fmt: skip
        self.records: list[CommandRecord] = []
        self.machines: dict[str, SimMachine] = {}
        self._conns: list[Any] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, label: str) -> None:
        plans = PlanCache()
        for c in range(math.ceil(len(self.names) / PER_CONNECTION)):
            self._conns.append(await bus.connect(self.url, f"simhost-{label}-{c}"))
        for i, name in enumerate(self.names):
            nc = self._conns[i // PER_CONNECTION]
            machine = SimMachine(
                nc, self.config, name, self.clock, self.timing, plans, self.records.append
            )
            self.machines[name] = machine
            await machine.start()
        for nc in self._conns:
            await nc.flush()  # every command subscription is known to the server
        self._tasks.append(asyncio.create_task(self._follow_state()))

    async def _follow_state(self) -> None:
        """Fences what the state fences. One follower for every machine of the host, and
        it reads only the newest state: a sidecar reads each revision, on a machine of
        its own; here that would be the host's CPU, taken from the services'."""
        while True:
            try:
                states = newest_states(self._conns[0], self.config.job)
                async for state in states:
                    for name, machine in self.machines.items():
                        if machine.alive and fenced_in(state, name, machine.instance):
                            machine.fenced(machine.instance)
                return
            except BucketNotFoundError:
                await asyncio.sleep(0.2)  # the planner creates it as it starts

    async def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "silence":
            return {"at": await self.machines[request["machine"]].silence()}
        if op == "revive":
            await self.machines[request["machine"]].revive()
            return {"ok": True}
        if op == "records":
            plans = set(request["plans"])
            return {"records": [asdict(r) for r in self.records if r.plan_id in plans]}
        raise ValueError(f"unknown request {op!r}")

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks, owner="simhost")
        for machine in self.machines.values():
            await machine.silence()
        for nc in self._conns:
            await nc.close()


async def _serve(args: argparse.Namespace) -> None:
    config = load_config(args.job_config)
    timing = SimTiming(**json.loads(args.timing))
    host = Host(args.nats_url, config, hosted(config, args.index, args.hosts),
                JobClock(args.job_start, timing.step_s), timing)  # fmt: skip
    await host.start(str(args.index))
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(json.dumps({"ready": len(host.machines)}), flush=True)
    try:
        while line := await reader.readline():
            request = json.loads(line)
            if request.get("op") == "quit":
                break
            try:
                reply = await host.answer(request)
            except Exception as err:  # a bad request is answered, the host goes on
                log.warning("request_failed", request=request, error=str(err))
                reply = {"error": f"{type(err).__name__}: {err}"}
            print(json.dumps(reply), flush=True)
    finally:
        await host.stop()


class SimHosts:
    """The parent's handle: `hosts` host processes for the job config at `config_path`."""

    def __init__(self, config: JobConfig, procs: list[asyncio.subprocess.Process]) -> None:
        self.config, self.procs = config, procs
        self._locks = [asyncio.Lock() for _ in procs]

    @classmethod
    async def start(
        cls,
        url: str,
        config_path: Path,
        hosts: int,
        job_start: float,
        timing: SimTiming,
        log_dir: Path,
        timeout_s: float,
    ) -> SimHosts:
        """Starts the hosts and returns once every one serves its machines."""
        procs = []
        for index in range(hosts):
            with open(log_dir / f"simhost-{index}.log", "ab") as err:  # noqa: ASYNC230 - a local file, opened once
                procs.append(
                    await asyncio.create_subprocess_exec(
                        sys.executable, "-m", "trainmover.bench.simhost", "--nats-url", url,
                        "--job-config", str(config_path), "--index", str(index),
                        "--hosts", str(hosts), "--job-start", repr(job_start),
                        "--timing", json.dumps(asdict(timing)),
                        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                        stderr=err, limit=REPLY_LIMIT,
                    )
                )  # fmt: skip
        self = cls(load_config(config_path), procs)
        try:
            for index, proc in enumerate(procs):
                assert proc.stdout is not None
                try:
                    line = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
                except TimeoutError:
                    raise TimeoutError(
                        f"simulated-machine host {index + 1} of {hosts} not serving its "
                        f"machines within {timeout_s:.0f} s"
                    ) from None
                if not line:
                    raise RuntimeError(f"a simulated-machine host exited ({proc.returncode})")
        except BaseException:
            await self.stop()
            raise
        return self

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _host_of(self, machine: str) -> int:
        everyone = [*self.config.cluster.machines, *self.config.cluster.standbys]
        return everyone.index(machine) % len(self.procs)

    async def _ask(self, index: int, request: dict[str, Any]) -> dict[str, Any]:
        proc = self.procs[index]
        assert proc.stdin is not None and proc.stdout is not None
        async with self._locks[index]:
            proc.stdin.write(json.dumps(request).encode() + b"\n")
            await proc.stdin.drain()
            line = await proc.stdout.readline()
        if not line:
            raise RuntimeError(f"simulated-machine host {index} exited ({proc.returncode})")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"simulated-machine host {index}: {reply['error']}")
        return reply

    async def silence(self, machine: str) -> float:
        """Kills `machine` (no heartbeat, no answer from now); returns when it went."""
        return float(
            (await self._ask(self._host_of(machine), {"op": "silence", "machine": machine}))["at"]
        )

    async def revive(self, machine: str) -> None:
        """Brings `machine` back as a fresh standby (a repaired machine)."""
        await self._ask(self._host_of(machine), {"op": "revive", "machine": machine})

    async def records(self, plan_ids: list[str]) -> list[CommandRecord]:
        """Every command answered for `plan_ids`, on every host."""
        replies = await asyncio.gather(
            *(self._ask(i, {"op": "records", "plans": plan_ids}) for i in range(len(self.procs)))
        )
        return [CommandRecord(**r) for reply in replies for r in reply["records"]]

    async def stop(self) -> None:
        """Asks every host to quit; kills one that does not within 20 s."""
        for proc in self.procs:
            if proc.stdin is not None and proc.returncode is None:
                proc.stdin.write(b'{"op": "quit"}\n')
                with contextlib.suppress(ConnectionError):
                    await proc.stdin.drain()
        for proc in self.procs:
            try:
                await asyncio.wait_for(proc.wait(), 20)
            except TimeoutError:
                proc.kill()
                await proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainmover.bench.simhost")
    p.add_argument("--nats-url", required=True)
    p.add_argument("--job-config", type=Path, required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--hosts", type=int, required=True)
    p.add_argument("--job-start", type=float, required=True, help="wall time of step 0")
    p.add_argument("--timing", default="{}", help="SimTiming fields as JSON")
    args = p.parse_args(argv)
    logs.configure(level="warning", stream=sys.stderr)  # stdout carries the replies
    try:
        asyncio.run(_serve(args))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
