"""A private network of namespaces for fault injection: one bridge in the host namespace,
one namespace per machine joined to it by a veth pair, private addresses.

Taking a machine's link down drops its packets without a reset (its TCP connections
stay open, its processes keep running): a silently failing NIC, as the hang tests and
`trainmover bench hangs` need it. Needs root and iproute2; every name carries a tag (the
caller's process id), so concurrent runs never share an interface or a namespace.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


def available() -> bool:
    """Whether this process can build namespaces (root and iproute2)."""
    return os.geteuid() == 0 and shutil.which("ip") is not None


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Lan:
    """The bridge (host address `.1`) and the namespaces on it, by machine name."""

    tag: str
    subnet: str
    bridge: str
    namespaces: dict[str, str] = field(default_factory=dict)
    host_veths: dict[str, str] = field(default_factory=dict)
    inner_veths: dict[str, str] = field(default_factory=dict)

    @property
    def host_address(self) -> str:
        return f"{self.subnet}.1"

    def add(self, machine: str) -> None:
        index = len(self.namespaces) + 2
        ns, host, inner = (
            f"tm{self.tag}-{machine}",
            f"tmh{self.tag}{index}",
            f"tmi{self.tag}{index}",
        )
        ip("netns", "add", ns)
        self.namespaces[machine] = ns
        ip("link", "add", host, "type", "veth", "peer", "name", inner)
        self.host_veths[machine] = host
        ip("link", "set", inner, "netns", ns)
        self.inner_veths[machine] = inner
        ip("link", "set", host, "master", self.bridge)
        ip("link", "set", host, "up")
        ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", ns, "addr", "add", f"{self.subnet}.{index}/24", "dev", inner)
        ip("-n", ns, "link", "set", inner, "up")

    def cut(self, machine: str) -> None:
        """A partition: the machine's cable is pulled; its processes keep running."""
        ip("link", "set", self.host_veths[machine], "down")

    def restore(self, machine: str) -> None:
        ip("link", "set", self.host_veths[machine], "up")

    def remove(self) -> None:
        for ns in self.namespaces.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for host in self.host_veths.values():  # normally gone with their namespace
            subprocess.run(["ip", "link", "del", host], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def machine_wrap(self, inside: set[str]) -> Callable[[str], tuple[list[str], dict[str, str]]]:
        """How the stack starts each machine: those in `inside` in their namespace (which
        must have been added), the others in the host namespace; gloo on the bridge."""

        def wrap(machine: str) -> tuple[list[str], dict[str, str]]:
            if machine in inside:
                prefix = ["ip", "netns", "exec", self.namespaces[machine]]
                return prefix, {"GLOO_SOCKET_IFNAME": self.inner_veths[machine]}
            return [], {"GLOO_SOCKET_IFNAME": self.bridge}

        return wrap


@contextlib.contextmanager
def private_lan(tag: str | None = None) -> Iterator[Lan]:
    """A bridge with its host address up, removed with everything on it at the end."""
    pid = os.getpid()
    tag = tag or f"{pid % 100000}"
    net = Lan(tag=tag, subnet=f"10.231.{pid % 250 + 1}", bridge=f"tmb{tag}")
    try:
        ip("link", "add", net.bridge, "type", "bridge")
        ip("addr", "add", f"{net.host_address}/24", "dev", net.bridge)
        ip("link", "set", net.bridge, "up")
        yield net
    finally:
        net.remove()
