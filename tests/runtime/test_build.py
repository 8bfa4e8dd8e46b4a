"""A group's gloo backend with several connections uses the interfaces that
GLOO_SOCKET_IFNAME names, as c10d's one-connection constructor does: a machine in a
network namespace of its own is reachable only there."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from trainmover.runtime.build import _make_backend


def _transfer_backend() -> object:
    return _make_backend(dist.HashStore(), 0, 1, timedelta(seconds=10), torch.device("cpu"), 2)


def test_a_transfer_backend_uses_the_interface_gloo_socket_ifname_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "tmnosuchif0")
    with pytest.raises(RuntimeError, match="tmnosuchif0"):
        _transfer_backend()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    backend = _transfer_backend()
    assert isinstance(backend, dist.ProcessGroupGloo) and backend.size() == 1
