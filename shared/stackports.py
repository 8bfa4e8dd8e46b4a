"""The HTTP ports of the services `trainmover up` runs: chosen, checked, read back.

By default every service binds a free port (`--http-port 0`) and writes the one it got
to a port file, so that two stacks on one host never contend for a port. With fixed
ports (for a Prometheus scrape configured against them) each port is checked free before
its service starts, and a service that exits before it serves is reported with the port
it was given: a stack that cannot serve says so and stops, instead of restarting a
service that can never bind in a loop.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from trainmover.ports import DEFAULT_HTTP_PORTS

#: Seconds a service has from its start to serving (it imports the runtime and connects
#: to the bus; on a loaded two-core host that has taken over 20 s).
READY_S = 120.0
#: Seconds between two looks for a service's port file.
LOOK_S = 0.05


class ServiceStartError(RuntimeError):
    """A service of the stack exited, or did not serve, before it was ready."""


def fixed_http_ports(services: list[str], base: int | None) -> dict[str, int]:
    """The fixed port of each of `services`: the well-known ones (DEFAULT_HTTP_PORTS)
    without `base`, else `base`, `base`+1, ... in DEFAULT_HTTP_PORTS' order."""
    if base is None:
        return {name: DEFAULT_HTTP_PORTS[name] for name in services}
    if not 0 < base <= 65535 - len(DEFAULT_HTTP_PORTS):
        raise ValueError(f"--fixed-ports {base}: not a port to start a block of ports at")
    order = list(DEFAULT_HTTP_PORTS)
    return {name: base + order.index(name) for name in services}


def port_in_use(port: int) -> bool:
    """Something on this host holds `port` (any address): a service could not bind it."""
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return True
    return False


def check_free(ports: dict[str, int]) -> None:
    """ServiceStartError naming the first of `ports` that another process holds."""
    for name, port in ports.items():
        if port_in_use(port):
            raise ServiceStartError(
                f"the {name}'s HTTP port {port} is in use by another process (another "
                "`trainmover up` on this host?): leave the ports free (the default) or "
                "give --fixed-ports a free BASE"
            )


async def wait_served(
    name: str, proc: asyncio.subprocess.Process, port_file: Path, fixed: int | None
) -> int:
    """The port `name` serves on, once it wrote `port_file`; ServiceStartError when the
    process exits first or takes longer than READY_S."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + READY_S
    while True:
        text = await asyncio.to_thread(_read, port_file)
        if text:
            return int(text)
        if proc.returncode is not None:
            cause = ""
            if fixed is not None and port_in_use(fixed):
                cause = f": its HTTP port {fixed} is in use by another process"
            raise ServiceStartError(
                f"the {name} exited with code {proc.returncode} before it served{cause}"
                + ("" if cause else " (its log says why)")
            )
        if loop.time() > deadline:
            raise ServiceStartError(f"the {name} did not serve within {READY_S:.0f} s")
        # The port file or the exit, whichever comes first.
        try:
            await asyncio.wait_for(asyncio.shield(proc.wait()), LOOK_S)
        except TimeoutError:
            pass


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return ""
