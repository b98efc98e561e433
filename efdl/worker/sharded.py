"""Sharded models (FSDP2): the model laid out anew on each world.

With ``torch.distributed.fsdp.fully_shard`` every rank holds rows of each parameter and of
its optimizer state (efdl.worker.layout). A rescale changes the number of shards, so every
rank's rows change. FSDP2 cannot lay
a module out again for another mesh, and a sharded module cannot be deep-copied; so
:func:`fully_shard` keeps a skeleton of the model as it was before sharding (its parameters
on the meta device: no memory; its buffers shared) and the script's own function that
shards it. On each new world efdl builds the model again from the skeleton, shards it on the
new mesh with that function, allocates only the new rows, and moves the rows each rank lacks
from the ranks that hold them (efdl.worker.transfer): no rank ever holds a whole tensor.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from efdl.worker.layout import Layout, rows

Shard0 = (Shard(0),)


@dataclass(slots=True)
class Sharding:
    """A model as it was before sharding (parameters on the meta device) and how to shard it."""

    skeleton: nn.Module
    shard: Callable[[nn.Module, DeviceMesh], Any]

    def build(self, mesh: DeviceMesh) -> nn.Module:
        """The model sharded on ``mesh``: its rows allocated (uninitialised) on the mesh's
        device, its buffers the skeleton's."""
        model = copy.deepcopy(self.skeleton, {id(b): b for b in self.skeleton.buffers()})
        self.shard(model, mesh)
        check(model)
        object.__setattr__(model, SHARDING, self)
        object.__setattr__(model, GROUP, _default_group())
        buffers = dict(model.named_buffers())
        model.to_empty(device=mesh.device_type)
        for name, buffer in buffers.items():  # to_empty made them anew: uninitialised
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._buffers[leaf] = buffer.to(mesh.device_type)
        return model


SHARDING = "_efdl_sharding"  # on a sharded model: its Sharding
GROUP = "_efdl_group"  # and the default group it was sharded over


def fully_shard(
    model: nn.Module,
    shard: Callable[[nn.Module, DeviceMesh], Any],
) -> nn.Module:
    """Shard ``model`` on this world's mesh with ``shard(model, mesh)`` (the script's own
    calls of ``torch.distributed.fsdp.fully_shard``), and remember how, so that efdl can
    shard it again on each new world. Returns the model, sharded.

    Call it after ``efdl.init_process_group()`` and before building the optimizer, with the
    model as built (on any device, or on the meta device with its weights initialised after).
    The ranks of a new world get a new model object: read it from ``state.model`` inside the
    training function.
    """
    if getattr(model, SHARDING, None) is not None or any(
        isinstance(p, DTensor) for p in model.parameters()
    ):
        raise ValueError(
            "efdl.fully_shard() takes the model before it is sharded (its parameters plain "
            "tensors): efdl calls your shard(model, mesh) itself, now and on each new world."
        )
    skeleton = copy.deepcopy(
        model,
        {
            **{
                id(p): nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
                for p in model.parameters()
            },
            **{id(b): b for b in model.buffers()},
        },
    )
    shard(model, mesh())
    check(model)
    object.__setattr__(model, SHARDING, Sharding(skeleton, shard))
    object.__setattr__(model, GROUP, _default_group())
    return model


def sharding_of(model: nn.Module) -> Sharding | None:
    found: Sharding | None = getattr(model, SHARDING, None)
    return found


def mesh() -> DeviceMesh:
    """This world's one-dimensional mesh over the default group, on efdl's device.

    Made from the default group itself, with no collective: ``init_device_mesh`` makes a new
    group for a CUDA mesh over gloo (a collective of every rank), which a newcomer would call
    alone while the survivors are in the state sync. A CUDA mesh takes the current device:
    made this worker's own GPU first, whatever the backend."""
    from efdl.worker.device import device

    own = device()
    if own.type == "cuda":
        torch.cuda.set_device(own)
    return DeviceMesh.from_group(_default_group(), own.type)


def check(model: nn.Module) -> None:
    """Every parameter of ``model`` sharded on dim 0 over a one-dimensional mesh (what efdl
    can lay out again); else an error that names the first that is not."""
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            raise ValueError(
                f"Parameter {name} is not sharded after your shard(model, mesh): call "
                "fully_shard on the root module too (efdl lays out sharded models only)."
            )
        if p.device_mesh.ndim != 1 or tuple(p.placements) != Shard0:
            raise ValueError(
                f"Parameter {name} is placed {tuple(p.placements)} on a {p.device_mesh.ndim}-"
                "dimensional mesh; efdl lays out parameters sharded on dim 0 (FSDP2's "
                "default) over a one-dimensional mesh only."
            )


def local(t: torch.Tensor) -> torch.Tensor:
    """A tensor's own rows: a DTensor's local tensor (writable, no autograd), else itself."""
    if isinstance(t, DTensor):
        out: torch.Tensor = t._local_tensor.detach()
        return out
    return t


def empty(shape: torch.Size, dtype: torch.dtype, on: DeviceMesh) -> DTensor:
    """A new tensor of ``shape`` sharded on dim 0 over ``on``: only this rank's rows,
    uninitialised."""
    layout = Layout(on.size(), on.get_local_rank())
    start, end = rows(shape[0], layout)
    data = torch.empty((end - start, *shape[1:]), dtype=dtype, device=on.device_type)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(data, on, Shard0, run_check=False, shape=shape, stride=stride)


def mesh_of(model: nn.Module) -> DeviceMesh:
    """The mesh ``model`` is sharded on."""
    for p in model.parameters():
        if isinstance(p, DTensor):
            return p.device_mesh
    raise ValueError("The model has no sharded parameter.")


def on_current_group(model: nn.Module) -> bool:
    """Whether ``model`` is sharded over this world's group (not a group since destroyed:
    the name of the one a mesh keeps may name a newer group by then)."""
    return dist.is_initialized() and getattr(model, GROUP, None) is _default_group()


def _default_group() -> Any:
    return dist.distributed_c10d._get_default_group()


def rebind(optimizer: torch.optim.Optimizer, old: nn.Module, new: nn.Module) -> None:
    """Point ``optimizer`` at ``new``'s parameters where it had ``old``'s of the same name
    (its state is loaded afterwards)."""
    names = {id(p): name for name, p in old.named_parameters()}
    params = dict(new.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [params[names[id(p)]] for p in group["params"]]
    optimizer.state.clear()


def release(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Free the rows of a model (and of its optimizer's state) laid out for a world that is
    gone. The script may still hold the model, as the variable it first sharded: a use of
    it now fails instead of training a stale copy."""
    tensors: list[torch.Tensor] = list(model.parameters())
    if optimizer is not None:
        tensors += [v for s in optimizer.state.values() for v in s.values()]
    for t in tensors:
        if isinstance(t, DTensor) and (storage := local(t).untyped_storage()).size():
            storage.resize_(0)
        t.grad = None
