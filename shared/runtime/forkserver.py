"""Worker processes forked from a warm parent instead of started cold.

A worker's start is mostly imports: torch, torch.distributed, the runtime, and
torch._dynamo (which the first optimizer construction imports), several CPU-seconds
per process, paid again by every standby brought back from maintenance or a fence. A
launcher (a machine's sidecar, a `LocalJob`) instead starts one fork server, which
imports all of that once and then forks each worker from itself; the child runs the
worker's entry module as `__main__` with its own environment, log file and process
group, as `python -m <entry>` would.

The server is single-threaded (forking a process with threads is unsafe) and imports
torch without initialising CUDA or any process group, so a child starts clean. It is
the children's parent: it reaps them and reports their exit codes to the launcher,
whose `ForkedWorker` handles answer like `subprocess.Popen` (`poll`, `wait`, `kill`).

Protocol, one JSON object per line: the launcher writes `{"entry", "env", "log",
"pgid"}` to the server's stdin; the server answers each with `{"pid"}` (or `{"error"}`)
on its stdout, in order, and adds `{"exited": pid, "code": n}` whenever a child ends
(`n` negative for a signal, as `Popen.returncode`).

`TRAINMOVER_FORK_SERVER=0` starts every worker as its own process instead.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ENV_SWITCH = "TRAINMOVER_FORK_SERVER"

#: What the server imports before it forks: the libraries every worker needs.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "trainmover.runtime.worker",
    "trainmover.runtime.reference",
)


def enabled() -> bool:
    """Whether launchers fork workers from a server (the default) or start them cold."""
    return os.environ.get(ENV_SWITCH, "1") != "0"


# --- the launcher's side ---------------------------------------------------------------


class ForkedWorker:
    """A worker forked by a `ForkServer`, answering like `subprocess.Popen`."""

    def __init__(self, server: ForkServer, process: _Process, pid: int) -> None:
        self._server = server
        self._process = process  # the server process that forked it, and reaps it
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._server.settle(self)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._server.wait_exit(self, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Process:
    """One run of the server process: its replies, and whether it has exited."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self.gone = False


class ForkServer:
    """One launcher's fork server, started at the first `spawn` (again if it died);
    `close` ends it (its workers keep running: stop them first)."""

    def __init__(self, log_path: Path, env: dict[str, str]) -> None:
        self._log_path = log_path
        self._env = env
        self._process: _Process | None = None
        self._lock = threading.Lock()  # one request in flight: replies come in order
        self._cond = threading.Condition()
        self._workers: dict[int, ForkedWorker] = {}
        self._codes: dict[int, int] = {}  # exits reported before their spawn returned

    def spawn(self, entry: str, env: dict[str, str], log: Path, pgid: int | None) -> ForkedWorker:
        """Forks a worker running `entry` with `env` added to the server's environment,
        its output appended to `log`, in process group `pgid` (0: a new one; None: the
        server's)."""
        with self._lock:
            process = self._start()
            assert process.popen.stdin is not None
            request = {"entry": entry, "env": env, "log": str(log), "pgid": pgid}
            try:
                process.popen.stdin.write(json.dumps(request).encode() + b"\n")
                process.popen.stdin.flush()
            except OSError as err:
                raise RuntimeError(f"the fork server has exited: {err}") from None
            reply = process.replies.get()
            if "pid" not in reply:
                raise RuntimeError(f"the fork server could not start {entry}: {reply}")
            worker = ForkedWorker(self, process, int(reply["pid"]))
            with self._cond:
                self._workers[worker.pid] = worker
                if worker.pid in self._codes:
                    worker.returncode = self._codes.pop(worker.pid)
            return worker

    def settle(self, worker: ForkedWorker) -> None:
        """With its server gone, nobody reports `worker`'s exit: look for it directly."""
        with self._cond:
            if worker.returncode is None and worker._process.gone and not _alive(worker.pid):
                worker.returncode = -signal.SIGKILL

    def wait_exit(self, worker: ForkedWorker, timeout: float | None) -> int | None:
        """`worker`'s exit code once it has exited; None if `timeout` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self.settle(worker)
                if worker.returncode is not None:
                    return worker.returncode
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(0.5 if remaining is None else min(remaining, 0.5))

    def close(self) -> None:
        process = self._process
        if process is not None and process.popen.poll() is None:
            process.popen.kill()
            process.popen.wait()

    def _start(self) -> _Process:
        if self._process is not None and self._process.popen.poll() is None:
            return self._process
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._log_path, "ab") as log:
            popen = subprocess.Popen(
                [sys.executable, "-m", "trainmover.runtime.forkserver"],
                env=self._env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
            )
        self._process = _Process(popen)
        threading.Thread(
            target=self._read, args=(self._process,), daemon=True, name="forkserver-reader"
        ).start()
        return self._process

    def _read(self, process: _Process) -> None:
        assert process.popen.stdout is not None
        for line in process.popen.stdout:
            message = json.loads(line)
            if "exited" not in message:
                process.replies.put(message)
                continue
            with self._cond:
                pid, code = int(message["exited"]), int(message["code"])
                if pid in self._workers:
                    self._workers.pop(pid).returncode = code
                else:
                    self._codes[pid] = code
                self._cond.notify_all()
        with self._cond:
            process.gone = True
            self._cond.notify_all()
        process.replies.put({"error": "the fork server exited"})


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        return True


# --- the server's side -------------------------------------------------------------------


def _preload() -> None:
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    import torch

    # The first optimizer construction imports torch._dynamo: once, here.
    torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])


def _fresh_random_state() -> None:
    """A process started cold seeds torch (and numpy) from the OS; a forked child would
    otherwise draw what every other child draws. (Python's `random` reseeds itself.)"""
    import torch

    torch.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _child(request: dict[str, Any]) -> int:
    """In the forked child: become the worker `request` describes, run it, its code."""
    import atexit
    import runpy
    import traceback

    pgid = request["pgid"]
    if pgid is not None:
        os.setpgid(0, pgid)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own descriptors
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.update(request["env"])
    _fresh_random_state()
    sys.argv = [request["entry"]]
    # As in a process started cold, the entry runs as __main__ only (not also under its
    # own name, which the preload may have imported).
    sys.modules.pop(request["entry"], None)
    code = 0
    try:
        runpy.run_module(request["entry"], run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        if isinstance(exit_.code, int):
            code = exit_.code
        elif exit_.code is not None:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # what the interpreter's exit would run
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def serve() -> None:
    """The server: preload, then fork one worker per request until stdin closes."""
    import selectors

    _preload()
    out = sys.stdout.buffer
    inbox = sys.stdin.buffer.fileno()
    sel = selectors.DefaultSelector()
    sel.register(inbox, selectors.EVENT_READ)
    pending = b""
    children: set[int] = set()

    def say(message: dict[str, Any]) -> None:
        out.write(json.dumps(message).encode() + b"\n")
        out.flush()

    while True:
        ready = sel.select(timeout=0.1)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            say({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
        if not ready:
            continue
        chunk = os.read(inbox, 65536)
        if not chunk:
            return  # the launcher is gone; its workers are its own to stop
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                sel.close()
                os._exit(_child(request))
            if request["pgid"] is not None:
                try:  # also here: the next worker of the machine may join it at once
                    os.setpgid(pid, request["pgid"])
                except OSError:
                    pass  # the child did it first, or is gone already
            children.add(pid)
            say({"pid": pid})


if __name__ == "__main__":
    serve()
