"""User values of a state: plain data that every load path reads back, and a clear refusal of
anything else where it enters (construction, assignment, commit)."""

from __future__ import annotations

import collections
import datetime
import inspect
import io
import re
from typing import Any

import numpy as np
import pytest
import torch

from efdl.worker.state import RESERVED, ElasticState
from efdl.worker.values import StateValueError, check

PLAIN: list[Any] = [
    None,
    True,
    3,
    2.5,
    complex(1, 2),
    "lr",
    b"\x00",
    torch.ones(2),
    torch.float16,
    torch.device("cpu"),
    torch.Size([2, 3]),
    [1, (2.0, "x")],
    {1, 2},
    {"a": {"b": [torch.zeros(1)]}, 3: None},
    collections.OrderedDict(a=1),
]


@pytest.mark.parametrize("value", PLAIN, ids=lambda v: type(v).__name__)
def test_plain_values_are_accepted_and_read_back_by_weights_only_loads(value: Any) -> None:
    check("v", value)
    buf = io.BytesIO()
    torch.save({"v": value}, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)["v"]
    assert type(back) is type(value)


@pytest.mark.parametrize(
    ("value", "where", "hint"),
    [
        (np.float32(0.5), "v", "float(x)"),
        (datetime.datetime(2026, 11, 23), "v", "isoformat"),
        (collections.defaultdict(int, a=1), "v", "dict(x)"),
        ({"best": [1, np.int64(3)]}, "v['best'][1]", "int(x)"),
        (slice(1, 2), "v", ""),
        (frozenset([1]), "v", ""),
        ({datetime.date(2026, 1, 1): 1}, "v (a key)", "isoformat"),
    ],
    ids=["numpy", "datetime", "defaultdict", "nested-numpy", "slice", "frozenset", "key"],
)
def test_other_values_are_refused_naming_where_and_what_to_store(
    value: Any, where: str, hint: str
) -> None:
    # ... and they are what weights-only loads cannot read (else refusing them would be wrong)
    buf = io.BytesIO()
    torch.save({"v": value}, buf)
    buf.seek(0)
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(buf, weights_only=True)
    with pytest.raises(StateValueError, match="The state value " + re.escape(where)) as err:
        check("v", value)
    assert hint in str(err.value) and "plain data" in str(err.value)


def test_the_state_refuses_them_at_construction_assignment_and_commit() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(StateValueError, match=r"The state value started is a datetime\.datetime"):
        ElasticState(model, started=datetime.datetime.now())
    state = ElasticState(model, best=[0.5], epoch=0)
    with pytest.raises(StateValueError, match=r"The state value best is a numpy"):
        state.best = np.float64(0.25)
    assert state.best == [0.5]  # nothing changed
    state.best.append(np.float64(0.25))  # in place: seen at the step boundary
    with pytest.raises(StateValueError, match=r"The state value best\[1\] is a numpy"):
        state.commit()
    assert state.step == 0  # refused before the step counted


@pytest.mark.parametrize("name", sorted(RESERVED))
def test_a_value_named_like_efdls_own_is_refused(name: str) -> None:
    """elastic_state(..., step=0) once made the user's counter efdl's commit counter: each
    step counted twice. Every name efdl keeps on a state is refused as a value, and read-only."""
    model = torch.nn.Linear(2, 2)
    if name not in inspect.signature(ElasticState).parameters:  # those are efdl's arguments
        with pytest.raises(StateValueError, match=f"The state value name '{name}' is efdl's own"):
            ElasticState(model, **{name: 0})
    state = ElasticState(model, epoch=0)
    before = getattr(state, name)
    with pytest.raises(StateValueError, match=f"state.{name} is efdl's own and read-only"):
        setattr(state, name, 5)
    assert getattr(state, name) == before


def test_the_users_counter_and_efdls_step_stay_apart() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = ElasticState(model, opt, epoch=0, my_step=0)
    for _ in range(3):
        opt.step()
        state.my_step += 1
        state.commit()
    assert (state.step, state.my_step) == (3, 3)
    with pytest.raises(StateValueError, match=r"state.best is not a value of this state"):
        state.best = 0.5  # undeclared: it would not go with the state
    with pytest.raises(
        AttributeError, match=r"no value 'best'; its values are \['epoch', 'my_step'\]"
    ):
        _ = state.best


@pytest.mark.parametrize("owned", ["process_group", "init_sync", "device_mesh"])
def test_ddp_options_efdl_sets_itself_are_refused_by_name(owned: str) -> None:
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match=f"ddp_kwargs sets '{owned}', which efdl sets"):
        ElasticState(model, ddp_kwargs={owned: None, "bucket_cap_mb": 1})
    with pytest.raises(ValueError, match="comm_hook is 3; expected a DDP communication hook"):
        ElasticState(model, comm_hook=3)  # type: ignore[arg-type]
