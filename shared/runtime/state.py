"""A role's full training state: capture, restore, and peer transfer over a group.

The state is everything a joiner needs to continue exactly where the leaver stopped:
parameters, optimizer state, the step counter, each stateful helper's state (the data
position) and every RNG state (torch's global one, CUDA's on a GPU, and the generators
registered here). Parameters and optimizer state are read and written through
`torch.distributed.checkpoint.state_dict`, the framework's own API.
It travels as one JSON header plus one flat byte buffer, so a transfer is three messages
whatever the model size, and the receiver checks names, shapes and dtypes against its own
model before copying anything.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trainmover.runtime.groups import Group

#: Separates a parameter's name from its optimizer state key in a tensor's name.
_KEY = ":"


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TransferStats:
    bytes: int
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainingState:
    """What a rank tracks for transfer; the integration surface of a user's loop."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    #: Objects with state_dict/load_state_dict whose state is JSON (e.g. the data reader).
    stateful: dict[str, Stateful] = field(default_factory=dict)
    #: Extra RNGs besides torch's global one (e.g. a dropout generator).
    generators: dict[str, torch.Generator] = field(default_factory=dict)
    #: Last completed step.
    step: int = 0

    # -- capture / restore -------------------------------------------------------------

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the state by a stable name (parameters, optimizer, RNG).

        Through `torch.distributed.checkpoint.state_dict`, so names are fully qualified
        parameter names whatever wraps the model (DDP's ``module.`` prefix is not part
        of them) and the same code serves sharded (DTensor) state."""
        model = get_model_state_dict(self.model)
        tensors = {f"model.{n}": cast(torch.Tensor, t).detach() for n, t in model.items()}
        for fqn, entry in sorted(self._optim_state()["state"].items()):
            for key, value in sorted(entry.items()):
                if isinstance(value, torch.Tensor):
                    tensors[f"optim.{fqn}{_KEY}{key}"] = value
        tensors["rng.torch"] = torch.get_rng_state()
        device = _device_of(self.model)
        if device.type == "cuda":
            tensors["rng.cuda"] = torch.cuda.get_rng_state(device)
        for name, gen in sorted(self.generators.items()):
            tensors[f"rng.{name}"] = gen.get_state()
        return tensors

    def _optim_state(self) -> dict[str, Any]:
        """The optimizer's state dict keyed by parameter name. An optimizer without state
        yet (no step taken) is left alone: reading it through the checkpoint API would
        initialise it with a step of learning rate zero, which counts as a step."""
        if not self.optimizer.state:
            return {"state": {}, "param_groups": None}
        return cast(dict[str, Any], get_optimizer_state_dict(self.model, self.optimizer))

    def header(self) -> dict[str, Any]:
        """The non-tensor part of the state."""
        opt = self._optim_state()
        return {
            "step": self.step,
            "stateful": {n: s.state_dict() for n, s in sorted(self.stateful.items())},
            "param_groups": opt["param_groups"],
            "optim_scalars": {
                fqn: {k: v for k, v in entry.items() if not isinstance(v, torch.Tensor)}
                for fqn, entry in opt["state"].items()
            },
        }

    def restore(self, header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Overwrites this rank's state with a captured one."""
        model = {n.removeprefix("model."): t for n, t in tensors.items() if n.startswith("model.")}
        set_model_state_dict(self.model, cast(dict[str, Any], model))
        if header["param_groups"] is None:
            self.optimizer.state.clear()  # the sender had not stepped yet either
        else:
            state: dict[str, dict[str, Any]] = {}
            for name, value in tensors.items():
                if name.startswith("optim."):
                    fqn, key = name.removeprefix("optim.").rsplit(_KEY, 1)
                    state.setdefault(fqn, {})[key] = value
            for fqn, scalars in header["optim_scalars"].items():
                state.setdefault(fqn, {}).update(scalars)
            own_groups = self.optimizer.param_groups
            groups = [
                {k: _like(mine.get(k), v) for k, v in theirs.items()}
                for mine, theirs in zip(own_groups, header["param_groups"], strict=True)
            ]
            set_optimizer_state_dict(
                self.model, self.optimizer, cast(Any, {"state": state, "param_groups": groups})
            )
        torch.set_rng_state(tensors["rng.torch"].cpu())
        if "rng.cuda" in tensors:
            torch.cuda.set_rng_state(tensors["rng.cuda"].cpu(), _device_of(self.model))
        for name, gen in self.generators.items():
            gen.set_state(tensors[f"rng.{name}"].cpu())
        for name, obj in self.stateful.items():
            obj.load_state_dict(header["stateful"][name])
        self.step = int(header["step"])

    def light(self) -> dict[str, Any]:
        """What a step changes besides parameters and optimizer (which only a committed
        step changes): helper states (data position) and RNGs. Taken at each step start
        so a discarded step can be rolled back and re-executed with the same data."""
        return {
            "stateful": {n: s.state_dict() for n, s in self.stateful.items()},
            "rng.torch": torch.get_rng_state(),
            "rng": {n: g.get_state() for n, g in self.generators.items()},
        }

    def restore_light(self, light: dict[str, Any]) -> None:
        for name, obj in self.stateful.items():
            obj.load_state_dict(light["stateful"][name])
        torch.set_rng_state(light["rng.torch"])
        for name, gen in self.generators.items():
            gen.set_state(light["rng"][name])

    def digest(self) -> str:
        """Hash of what data-parallel replicas must hold identically: step, parameters and
        optimizer state (not RNGs, which are per replica)."""
        h = hashlib.sha256(str(self.step).encode())
        for name, t in self.named_tensors().items():
            if not name.startswith("rng."):
                h.update(name.encode())
                h.update(_as_bytes(t.cpu()).numpy().tobytes())
        return h.hexdigest()[:16]

    # -- peer transfer -----------------------------------------------------------------

    def send(self, group: Group, peer: int, extra: dict[str, Any] | None = None) -> TransferStats:
        """Sends the whole state to `peer` (the joiner's rank in a transfer pair), with
        `extra` (the runtime's own JSON, e.g. the vote epoch) alongside."""
        started = time.perf_counter()
        tensors = self.named_tensors()
        meta = {
            "extra": extra or {},
            "header": self.header(),
            "tensors": [
                [n, list(t.shape), str(t.dtype).removeprefix("torch.")] for n, t in tensors.items()
            ],
        }
        device = _device_of(self.model)
        meta_bytes = _bytes_tensor(json.dumps(meta).encode(), device)
        payload = torch.cat([_as_bytes(t).to(device) for t in tensors.values()])
        sizes = torch.tensor(
            [meta_bytes.numel(), payload.numel()], dtype=torch.int64, device=device
        )
        for tag, tensor in enumerate((sizes, meta_bytes, payload)):
            group.send(tensor, peer, tag=tag).wait()
        return TransferStats(bytes=int(payload.numel()), seconds=time.perf_counter() - started)

    def receive(self, group: Group, peer: int) -> TransferStats:
        """Receives a state sent by `send` from `peer` and restores it; the sender's
        `extra` is in the returned stats."""
        started = time.perf_counter()
        device = _device_of(self.model)
        sizes = torch.empty(2, dtype=torch.int64, device=device)
        group.recv(sizes, peer, tag=0)
        meta_bytes = torch.empty(int(sizes[0]), dtype=torch.uint8, device=device)
        group.recv(meta_bytes, peer, tag=1)
        payload = torch.empty(int(sizes[1]), dtype=torch.uint8, device=device)
        group.recv(payload, peer, tag=2)
        meta = json.loads(bytes(meta_bytes.cpu().numpy()).decode())
        tensors = _unpack(payload, meta["tensors"])
        _check_matches(tensors, self.named_tensors())
        self.restore(meta["header"], tensors)
        return TransferStats(
            bytes=int(payload.numel()),
            seconds=time.perf_counter() - started,
            extra=meta.get("extra", {}),
        )

    # -- files -------------------------------------------------------------------------

    def save(self, path: Path) -> None:
        """Writes the state (for comparisons between runs), atomically."""
        tmp = path.with_suffix(".tmp")
        torch.save({"header": self.header(), "tensors": self.named_tensors()}, tmp)
        tmp.replace(path)


def load_saved(path: Path) -> dict[str, Any]:
    """A saved state: {"header": ..., "tensors": {name: tensor}}."""
    return torch.load(path, weights_only=False)


def _like(own: Any, received: Any) -> Any:
    """The received value with the container type of our own (JSON turns tuples such as
    Adam's betas into lists)."""
    return tuple(received) if isinstance(own, tuple) and isinstance(received, list) else received


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _bytes_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _unpack(payload: torch.Tensor, manifest: list[list[Any]]) -> dict[str, torch.Tensor]:
    tensors, offset = {}, 0
    for name, shape, dtype_name in manifest:
        dtype = getattr(torch, dtype_name)
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        chunk = payload[offset : offset + nbytes].clone()
        tensors[name] = chunk.view(dtype).reshape(shape)
        offset += nbytes
    return tensors


def _check_matches(received: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> None:
    """The joiner must have built the same role: same parameter names and shapes. (Its
    optimizer may not have state yet, so only the model part must match exactly.)"""
    for name, t in own.items():
        if name.startswith("model.") and (name not in received or received[name].shape != t.shape):
            raise ValueError(f"state mismatch at {name}: the joiner built a different role")
