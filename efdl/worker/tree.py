"""What one rank holds of the job's state, as one tree, and whether it is a committed step's.

The tree (:meth:`StateTree.tree`) is the model's, optimizer's, scheduler's and sampler's state
dicts, the committed step count and the user values: what the sync sends (efdl.worker.sync), a
snapshot stores (efdl.worker.persist) and a rollback copy clones. Its tensors are named by their
key path (``['model']['0.weight']``, :func:`key`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from efdl.worker import sharded, transfer
from efdl.worker.digest import digest
from efdl.worker.layout import Layout
from efdl.worker.sampler import Position
from efdl.worker.transaction import Standing
from efdl.worker.values import UserValues


class StateTree:
    """One rank's part of the job's state (efdl.worker.state.ElasticState keeps one).

    Attributes:
        model: the module; a sharded one is replaced when it is laid out on a new world.
        optimizer, scheduler, sampler: the script's, or None.
        values: the user values.
        step: the committed steps.
        sharding: how to build the sharded model again (efdl.worker.sharded); None: replicated.
        layout: the rows this rank holds (sharded); None before it holds any.
        rows: rows handed over at a pause, held apart from the model (sharded).
        holds: the tensors are a committed step's (False: new, or torn).
        settled: and so is the rest (False after a roll-forward).
        torn: it held state and a failure tore it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Any,
        sampler: Position | None,
        values: UserValues,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.sampler = sampler
        self.values = values
        self.step = 0
        self.sharding = sharded.sharding_of(model)
        self.layout: Layout | None = None
        self.rows: dict[str, transfer.Region] | None = None
        self.holds = False
        self.settled = True
        self.torn = False

    def tree(self) -> dict[str, Any]:
        """The state as one tree (the script's tensors themselves: no copy)."""
        return {
            "model": self.model.state_dict(),
            # `is not None`, never truthiness: a sampler at the end of its epoch has length 0
            # (a crash right after an epoch's last commit then lost the cursor, and the
            # finished epoch was trained again).
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            "step": self.step,
            "values": self.values.data,
        }

    def clone(self) -> dict[str, Any]:
        """A rollback copy: tensors cloned on their own device (no host synchronisation)."""
        cloned: dict[str, Any] = clone_tree(self.tree())
        return cloned

    def load(self, tree: dict[str, Any], model_in_place: bool) -> None:
        """Take ``tree`` as this rank's state. ``model_in_place``: the model's tensors in it
        are the model's own (received in place): nothing to copy."""
        if not model_in_place:
            self.model.load_state_dict(tree["model"])
        if self.optimizer is not None and tree["optimizer"] is not None:
            self.optimizer.load_state_dict(tree["optimizer"])  # adopts the tensors: no copy
        if self.scheduler is not None and tree["scheduler"] is not None:
            self.scheduler.load_state_dict(tree["scheduler"])
        if self.sampler is not None and tree["sampler"] is not None:
            self.sampler.load_state_dict(tree["sampler"])
        self.step = int(tree["step"])
        self.values.data.update(tree["values"])

    def count_step(self) -> None:
        """One more step committed (or rolled forward): the sampler moves past its batch."""
        self.step += 1
        if self.sampler is not None:
            self.sampler.advance()

    def standing(self, generation: int) -> Standing:
        """What this rank holds, as the sync compares it (``generation``: the one it trains
        in)."""
        if not self.holds:
            return Standing(None, torn=self.torn)
        return Standing(self.step, self.settled, generation=generation)

    def buffer_keys(self) -> set[str]:
        """The key paths of the model's buffers (what the next forward changes, and DDP
        broadcasts from rank 0)."""
        return {key("model", name) for name, _ in self.model.named_buffers()}

    def own_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's tensors by key path: what a received tensor may land in."""
        leaves, _ = pytree.tree_flatten_with_path(self.tree())
        return {pytree.keystr(p): t for p, t in leaves if isinstance(t, torch.Tensor)}

    def digest(self) -> int:
        """This replica's digest (efdl.worker.digest) of its parameters and optimizer state; 0
        where there is none to compare: a rank that holds no step, or a sharded state (its
        rows differ by design). Buffers are left out: DDP broadcasts them from rank 0 only at
        the next forward (batch-norm statistics differ between replicas until then)."""
        if not self.holds or self.sharding is not None:
            return 0
        buffers = self.buffer_keys()
        return digest(
            t
            for k, t in self.own_tensors().items()
            if k.startswith(("['model']", "['optimizer']")) and k not in buffers
        )

    def on_this_world(self) -> torch.nn.Module:
        """The sharded model on this world's mesh: the model itself if it is sharded over
        this group already (a newcomer, a cold start), else built anew."""
        assert self.sharding is not None
        if sharded.on_current_group(self.model):
            return self.model
        return self.sharding.build(sharded.mesh())

    def adopt(self, model: torch.nn.Module, tree: dict[str, Any]) -> None:
        """Take ``model`` (sharded on this world's mesh, its rows in ``tree``) and ``tree`` as
        this rank's state; free the old model's rows."""
        old = self.model
        if model is not old and self.optimizer is not None:
            sharded.rebind(self.optimizer, old, model)
        self.model = model
        self.load(tree, model_in_place=True)
        self.layout, self.rows = Layout(dist.get_world_size(), dist.get_rank()), None
        if model is not old:
            sharded.release(old, None)


def key(*names: str) -> str:
    """The key path of a tensor in the tree: ``key("model", "0.weight")``."""
    return pytree.keystr(tuple(pytree.MappingKey(n) for n in names))


def clone_tree(tree: Any) -> Any:
    """``tree`` with its tensors cloned on their own devices and everything else deep-copied."""
    return pytree.tree_map(
        lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else copy.deepcopy(x), tree
    )
