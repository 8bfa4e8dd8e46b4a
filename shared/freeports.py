"""Free ports on this host for the processes the embedded stack starts (their ports are
fixed for the stack's life: a restarted process comes back where its clients look)."""

from __future__ import annotations

import socket


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports free on `host` now."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def free_port_block(n: int, host: str = "127.0.0.1", tries: int = 100) -> int:
    """The first of `n` consecutive ports free on `host` now (a store replica and the
    shards on the ports after it)."""
    for _ in range(tries):
        socks: list[socket.socket] = []
        try:
            first = socket.socket()
            socks.append(first)
            first.bind((host, 0))
            base = first.getsockname()[1]
            if base + n > 65536:
                continue
            for port in range(base + 1, base + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {n} consecutive free ports on {host}")
