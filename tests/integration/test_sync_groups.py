"""The state sync of an in-place rebuild, with real torch.distributed (gloo) processes.

With NCCL, a collective on the training group must never carry a CPU tensor (NCCL groups have
no CPU backend): control and CPU tensors go over the CPU side group, device tensors over the
training group. On CPU every tensor is a CPU tensor, so here the training group must carry no
collective at all, while newcomers still receive the survivor's whole state.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.ranks import run_ranks

SCRIPT = Path(__file__).parent / "scripts" / "sync_groups.py"


@pytest.mark.timeout(120)
def test_sync_sends_no_cpu_tensor_over_the_training_group(tmp_path: Path) -> None:
    world = 3
    args = [
        [str(r), str(world), str(tmp_path / "store"), str(tmp_path / f"rank{r}.json")]
        for r in range(world)
    ]
    run_ranks(SCRIPT, args)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for r in ranks:
        assert r["calls"], "the sync made no collective at all"
        on_training = [c for c in r["calls"] if c["training"] and c["device"] == "cpu"]
        assert not on_training, f"CPU tensors on the training group: {on_training}"
        # The newcomers got everything: parameters, Adam's moments, step, user values.
        assert (r["params"], r["moments"], r["step"], r["epoch"]) == (
            ranks[0]["params"],
            ranks[0]["moments"],
            2,
            3,
        )
