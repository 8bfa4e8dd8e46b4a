"""torchft as a third system in the downtime benchmark: DP replica groups of the same
model under a lighthouse, one replica SIGKILLed and restarted at once, healed from a live
peer while the survivors carry on with fewer replicas.

Measured per heartbeat timeout of the lighthouse:
- survivors' stall (``downtime_s``): the survivor's longest step from the kill to its
  first step with every replica again after the heal, less a normal step. The step in
  flight at the kill often ends at once (the victim had already given its gradients)
  and the wait for the lighthouse's timeout lands on a later step, so the first step
  after the kill alone (docs/glossary.md's downtime) can read as no stall. ``lost_s``:
  that span less a normal step per step committed in it (reduced-batch steps counted as
  whole: their missing work is ``lost_steps_equivalent``);
- heal: kill -> the restarted replica's first committed step;
- reduced-batch steps: survivor steps committed with fewer than all replicas, and the
  work they lost (the missing replicas' share of those steps' batches).
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from trainmover.bench.ckpt_restart import free_port
from trainmover.bench.report import NotMeasurable, Result, first_reason, successes
from trainmover.bench.role import read_events
from trainmover.runtime.config import JobConfig, save_config

#: torchft_lighthouse's default --heartbeat_timeout_ms.
DEFAULT_HEARTBEAT_TIMEOUT_S = 5.0
#: The quorum settings of torchft's README example.
LIGHTHOUSE_ARGS = ["--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000"]


def _lighthouse() -> str:
    path = Path(sys.executable).parent / "torchft_lighthouse"
    try:
        import torchft  # noqa: F401
    except ImportError as exc:
        raise NotMeasurable(
            f"torchft is not installed ({exc}); pip install -e '.[bench]' (see docs/benchmarks.md)"
        ) from None
    if not path.exists():
        raise NotMeasurable(f"{path} not found (torchft-nightly installs it)")
    return str(path)


class _Sessions:
    """Processes this harness started, each in its own session (ended by group id)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()


def _wait(predicate: Any, what: str, timeout_s: float, procs: list[subprocess.Popen[bytes]]) -> Any:
    deadline = time.time() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        dead = [str(p.args) for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"torchft process exited while waiting for {what}: {dead[0]}")
        if time.time() > deadline:
            raise TimeoutError(f"torchft: timed out waiting for {what}")
        time.sleep(0.02)


def survivor_stall(
    span: list[dict[str, Any]], last_before: float, normal: float
) -> tuple[float, float]:
    """(longest step less a normal one, training time lost) of a survivor whose steps
    `span` (step events in order, through its first whole step after the heal) followed
    its last step before the kill, ending at `last_before`; see the module docstring."""
    ends = [last_before, *(e["t"] for e in span)]
    committed = sum(1 for e in span if e["committed"])
    longest = max(b - a for a, b in zip(ends, ends[1:], strict=False))
    return longest - normal, ends[-1] - last_before - committed * normal


def failure(
    config: JobConfig, run_dir: Path, heartbeat_timeout_s: float, warm_steps: int,
    timeout_s: float = 300.0,
) -> dict[str, Any]:  # fmt: skip
    """One kill-and-heal of the last replica group; see the module docstring."""
    lighthouse = _lighthouse()
    replicas = config.layout.dp
    if replicas < 2:
        raise NotMeasurable("torchft needs at least 2 DP replicas")
    run_dir.mkdir(parents=True, exist_ok=True)
    events_dir = run_dir / "events"
    config_path = save_config(config, run_dir / "job.json")
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}"}
    sessions = _Sessions()
    try:
        sessions.start(
            [lighthouse, *LIGHTHOUSE_ARGS, "--bind", f"127.0.0.1:{port}",
             "--heartbeat_timeout_ms", str(int(heartbeat_timeout_s * 1000))],
            run_dir / "lighthouse.log", env,
        )  # fmt: skip

        def replica(i: int) -> subprocess.Popen[bytes]:
            cmd = [sys.executable, "-m", "trainmover.bench.torchft_train", "--config",
                   str(config_path), "--run-dir", str(run_dir), "--replica", str(i)]  # fmt: skip
            return sessions.start(cmd, run_dir / f"replica{i}.log", env)

        workers = [replica(i) for i in range(replicas)]

        def steps(i: int, after: float = 0.0) -> list[dict[str, Any]]:
            return [e for e in read_events(events_dir)
                    if e["event"] == "step" and e["replica"] == i and e["t"] > after]  # fmt: skip

        def full_steps(i: int) -> int:
            return sum(1 for e in steps(i) if e["committed"] and e["participants"] == replicas)

        _wait(lambda: all(full_steps(i) >= warm_steps for i in range(replicas)),
              "warm-up", timeout_s, workers)  # fmt: skip
        survivor, victim = 0, replicas - 1
        last = steps(survivor)[-6:]  # up to 5 periods; fewer when warm_steps is small
        normal = statistics.median(b["t"] - a["t"] for a, b in zip(last, last[1:], strict=False))
        time.sleep(normal / 2)  # in the middle of a step
        t_kill = time.time()
        os.killpg(workers[victim].pid, signal.SIGKILL)
        workers[victim].wait()
        last_before = max(e["t"] for e in steps(survivor) if e["t"] <= t_kill)
        workers[victim] = replica(victim)  # restarted at once, as torchrun would

        def healed() -> dict[str, Any] | None:
            return next((e for e in steps(victim, t_kill) if e["committed"]), None)

        heal = _wait(healed, "the restarted replica's first committed step", timeout_s, workers)

        def whole_again() -> dict[str, Any] | None:
            return next((e for e in steps(survivor, heal["t"])
                         if e["committed"] and e["participants"] == replicas), None)  # fmt: skip

        back = _wait(whole_again, "the survivor's first step with every replica", timeout_s,
                     workers)  # fmt: skip
        span = [e for e in steps(survivor, t_kill) if e["t"] <= back["t"]]
        survived = [e for e in span if e["t"] <= heal["t"]]
        reduced = [e for e in survived if e["committed"] and e["participants"] < replicas]
        stall, lost = survivor_stall(span, last_before, normal)
        return {
            "heartbeat_timeout_s": heartbeat_timeout_s,
            "normal_step_s": normal,
            "downtime_s": stall,
            "lost_s": lost,
            "heal_s": heal["t"] - t_kill,
            "reduced_batch_steps": len(reduced),
            "lost_steps_equivalent": sum(1 - e["participants"] / replicas for e in reduced),
            "uncommitted_survivor_steps": sum(1 for e in survived if not e["committed"]),
        }
    finally:
        sessions.close()


def summarize(result: Result, rows: dict[str, list[Any]], timeouts: list[float]) -> None:
    """torchft's keys: failure_downtime_s (survivors' stall at the default timeout) and,
    per timeout, stall, heal time and reduced-batch work."""
    if not timeouts:
        result.set("torchft.failure_downtime_s", None, "skipped (--torchft-timeouts empty)")
        return
    for hb in timeouts:
        values = rows.get(f"torchft.hb{hb:g}", [])
        ok = successes(values)
        why = first_reason(values)
        base = f"torchft.heartbeat_{hb:g}s"
        result.set_median(f"{base}.stall_s", [r["downtime_s"] for r in ok], why)
        result.set_median(f"{base}.lost_s", [r["lost_s"] for r in ok], why)
        result.set_median(f"{base}.heal_s", [r["heal_s"] for r in ok], why)
        result.set_median(
            f"{base}.reduced_batch_steps", [r["reduced_batch_steps"] for r in ok], why
        )
        result.set_median(f"{base}.lost_steps_equivalent",
                          [r["lost_steps_equivalent"] for r in ok], why)  # fmt: skip
    default = (
        DEFAULT_HEARTBEAT_TIMEOUT_S if DEFAULT_HEARTBEAT_TIMEOUT_S in timeouts else timeouts[0]
    )
    values = rows.get(f"torchft.hb{default:g}", [])
    result.set_median("torchft.failure_downtime_s", [r["downtime_s"] for r in successes(values)],
                      first_reason(values))  # fmt: skip
    result.set("torchft.failure_downtime_heartbeat_timeout_s", default)
