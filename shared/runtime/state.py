"""A role's full training state: capture, restore, and peer transfer over a group.

The state is everything a joiner needs to continue exactly where the leaver stopped:
parameters, optimizer state, the step counter, each stateful helper's state (the data
position) and every RNG state (torch's global one, CUDA's on a GPU, and the generators
registered here). Parameters and optimizer state are read and written through
`torch.distributed.checkpoint.state_dict`, the framework's own API.
It travels streamed, tensor by tensor in bounded chunks from its own storage
(`trainmover.runtime.transfer`), and is restored only once it arrived whole.
"""

from __future__ import annotations

import hashlib
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
from torch.distributed.tensor import DTensor

from trainmover.runtime.groups import Group
from trainmover.runtime.transfer import (
    CHUNK_BYTES,
    TransferStats,
    as_bytes,
    receive_state,
    send_state,
)

#: Separates a parameter's name from its optimizer state key in a tensor's name.
_KEY = ":"


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


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
        of them). Sharded (DTensor) state is this rank's local shards, views of their
        own storage: what a joiner of the same role holds, one to one."""
        model = get_model_state_dict(self.model)
        tensors = {f"model.{n}": _local(cast(torch.Tensor, t)) for n, t in model.items()}
        for fqn, entry in sorted(self._optim_state()["state"].items()):
            for key, value in sorted(entry.items()):
                if isinstance(value, torch.Tensor):
                    tensors[f"optim.{fqn}{_KEY}{key}"] = _local(value)
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

    def prime(self) -> None:
        """Gives an optimizer that has not stepped its state's tensors, through the
        checkpoint API (which initialises it with a step of learning rate zero), so that
        a state received later lands in place. Only for a rank whose whole state is then
        overwritten (a joiner): on any other it would count as a step."""
        if not self.optimizer.state:
            get_optimizer_state_dict(self.model, self.optimizer)

    def restore(self, header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Overwrites this rank's state with a captured one."""
        self._restore(header, tensors, self.named_tensors())

    def _restore(
        self, header: dict[str, Any], tensors: dict[str, torch.Tensor], own: dict[str, torch.Tensor]
    ) -> None:
        if _write_in_place(header, tensors, own):
            self._load_param_groups(header["param_groups"])
        else:
            self._load_state_dicts(header, tensors)
        torch.set_rng_state(tensors["rng.torch"].cpu())
        if "rng.cuda" in tensors:
            torch.cuda.set_rng_state(tensors["rng.cuda"].cpu(), _device_of(self.model))
        for name, gen in self.generators.items():
            gen.set_state(tensors[f"rng.{name}"].cpu())
        for name, obj in self.stateful.items():
            obj.load_state_dict(header["stateful"][name])
        self.step = int(header["step"])

    def _load_state_dicts(self, header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Parameters and optimizer state through `set_model_state_dict` and
        `set_optimizer_state_dict`: for a state whose tensors have no place of their own
        yet here (an optimizer that never stepped, a layout that differs)."""
        own = {n: t for n, t in get_model_state_dict(self.model).items() if isinstance(t, DTensor)}
        model = {
            n.removeprefix("model."): _shaped_like(own.get(n.removeprefix("model.")), t)
            for n, t in tensors.items()
            if n.startswith("model.")
        }
        set_model_state_dict(self.model, cast(dict[str, Any], model))
        if header["param_groups"] is None:
            self.optimizer.state.clear()  # the sender had not stepped yet either
            return
        state: dict[str, dict[str, Any]] = {}
        for name, value in tensors.items():
            if name.startswith("optim."):
                fqn, key = name.removeprefix("optim.").rsplit(_KEY, 1)
                state.setdefault(fqn, {})[key] = _shaped_like(own.get(fqn), value)
        for fqn, scalars in header["optim_scalars"].items():
            state.setdefault(fqn, {}).update(scalars)
        set_optimizer_state_dict(
            self.model,
            self.optimizer,
            cast(
                Any,
                {"state": state, "param_groups": self._groups_like_ours(header["param_groups"])},
            ),
        )

    def _groups_like_ours(self, theirs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [
            {k: _like(mine.get(k), v) for k, v in group.items()}
            for mine, group in zip(self.optimizer.param_groups, theirs, strict=True)
        ]

    def _load_param_groups(self, theirs: list[dict[str, Any]]) -> None:
        """The sender's hyperparameters (learning rate, betas, ...) into our optimizer's
        groups; their parameters are ours already, by name."""
        for mine, group in zip(
            self.optimizer.param_groups, self._groups_like_ours(theirs), strict=True
        ):
            mine.update({k: v for k, v in group.items() if k != "params"})

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
                h.update(cast(Any, as_bytes(t.cpu()).numpy()).data)  # no copy of the tensor
        return h.hexdigest()[:16]

    # -- peer transfer -----------------------------------------------------------------

    def send(
        self,
        group: Group,
        peer: int,
        extra: dict[str, Any] | None = None,
        chunk_bytes: int = CHUNK_BYTES,
        checksums: bool = True,
    ) -> TransferStats:
        """Streams the whole state to `peer` (the joiner's rank in a transfer pair), with
        `extra` (the runtime's own JSON, e.g. the vote epoch) alongside."""
        tensors, device = self.named_tensors(), _device_of(self.model)
        return send_state(
            group, peer, self.header(), tensors, device, extra, chunk_bytes, checksums
        )

    def receive(self, group: Group, peer: int) -> TransferStats:
        """Receives a state streamed by `send` from `peer` and restores it once it arrived
        whole (`trainmover.runtime.transfer`); the sender's `extra` is in the returned
        stats."""
        own = self.named_tensors()
        received = receive_state(group, peer, own, _device_of(self.model))
        self._restore(received.header, received.tensors, own)
        return received.stats

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


def _write_in_place(
    header: dict[str, Any], tensors: dict[str, torch.Tensor], own: dict[str, torch.Tensor]
) -> bool:
    """Writes the received parameters and optimizer state into the storage of our own
    (the local shards the checkpoint API hands out, written as `load_state_dict` would),
    when each has its place here with the same shape and dtype and the optimizer state
    has no scalars besides its tensors; False, having written nothing, otherwise. This
    spares DTensor's sharding propagation, which a first `copy_` or optimizer step on
    each distinct shard runs: tens of milliseconds per tensor, on the joiner's critical
    path. A transfer received into our own storage has nothing left to write."""
    theirs = {n: t for n, t in tensors.items() if n.startswith(("model.", "optim."))}
    mine = {n: t for n, t in own.items() if n.startswith(("model.", "optim."))}
    # A sender that never stepped has no optimizer state: ours is cleared by the loaders.
    unstepped = header["param_groups"] is None
    if unstepped or any(header["optim_scalars"].values()) or theirs.keys() != mine.keys():
        return False
    if any(t.shape != mine[n].shape or t.dtype != mine[n].dtype for n, t in theirs.items()):
        return False
    with torch.no_grad():
        for name, t in theirs.items():
            if t.data_ptr() != mine[name].data_ptr() or t.stride() != mine[name].stride():
                mine[name].copy_(t)
    return True


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local shard (a view of its storage)."""
    return t.to_local().detach() if isinstance(t, DTensor) else t.detach()


def _shaped_like(own: torch.Tensor | None, local: torch.Tensor) -> torch.Tensor:
    """A received local tensor as the DTensor this rank's own state holds under its name
    (same mesh, placements and global shape), when it holds one of that local shape: a
    parameter's shard, or an optimizer state shaped like its parameter (Adam's moments);
    anything else (a step count) as it came."""
    if not isinstance(own, DTensor) or own.to_local().shape != local.shape:
        return local
    return DTensor.from_local(
        local,
        own.device_mesh,
        own.placements,
        run_check=False,
        shape=own.shape,
        stride=own.stride(),
    )


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
