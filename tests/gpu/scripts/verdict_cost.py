"""What the step verdicts cost on a GPU: DDP over NCCL at world size 1, an MLP of 4M, 25M and
100M parameters trained with AdamW, with and without what ``commit()`` adds for the verdict
(a CUDA event recorded after the step's work, ``ProcessGroupNCCL.get_error()``, and a query of
the older events: no synchronisation). Blocks of steps alternate between the two; each block
is timed from a synchronised start to a synchronised end. Prints one JSON line per size.

Variants: ``plain`` (no verdict), ``ring`` (efdl's: a ring of re-recorded events,
Runtime.step_event), ``fresh`` (a new event per step, as before the ring), and the pieces
alone: ``record`` (the ring's event record) and ``record_errored`` (and get_error()), and
``plain_again`` (plain once more: the spread of the method itself). It first times
the pieces alone (microseconds per call).

Usage: python tests/gpu/scripts/verdict_cost.py [--sizes 4,25,100] [--blocks 10] [--steps 40]
"""

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import efdl
from efdl._process import free_port
from efdl.protocol.messages import Placement
from efdl.worker.runtime import get_runtime
from efdl.worker.verdict import Verdicts

rt = get_runtime()


def mlp(millions: int) -> torch.nn.Sequential:
    width = 1024 if millions <= 8 else 2048 if millions <= 40 else 3584
    layers = max(1, round(millions * 1e6 / (width * width + width)))
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks)


def block(
    model: DDP,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    steps: int,
    hook: Callable[[int], object] | None,
    first: int,
) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        if hook is not None:
            hook(first + i)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def fresh_event() -> torch.cuda.Event:
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    return event


def micro(n: int = 20000) -> dict[str, float]:
    """Microseconds per call of each piece: first a query of an event the GPU has not reached
    (behind about a second of GPU sleep), then the rest on an idle GPU."""
    out = {}
    torch.cuda._sleep(2_000_000_000)  # type: ignore[no-untyped-call]
    pending = torch.cuda.Event()  # type: ignore[no-untyped-call]
    pending.record()
    t0 = time.perf_counter()
    for _ in range(n):
        pending.query()  # type: ignore[no-untyped-call]
    out["query_pending_us"] = (time.perf_counter() - t0) / n * 1e6
    out["still_pending"] = float(not pending.query())  # type: ignore[no-untyped-call]
    reused = torch.cuda.Event()  # type: ignore[no-untyped-call]
    reused.record()
    pieces: dict[str, Callable[[], object]] = {
        "new_event_and_record": fresh_event,
        "record_reused_event": reused.record,
        "query_done": reused.query,
        "errored": rt.errored,
        "ring_step_event": rt.step_event,
    }
    for name, fn in pieces.items():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out[name + "_us"] = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="4,25,100")
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    rt.backend = "nccl"
    torch.cuda.set_device(efdl.device())
    rt.init_group(Placement(1, 0, 1, 0, 1, 0, 1, "127.0.0.1", free_port()))
    print(json.dumps(micro()), flush=True)
    for millions in (int(s) for s in args.sizes.split(",")):
        torch.manual_seed(0)
        net = mlp(millions).cuda()
        params = sum(p.numel() for p in net.parameters())
        model = DDP(net, device_ids=[torch.cuda.current_device()])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        x = torch.randn(64, next(net.parameters()).shape[1], device="cuda")
        ring = Verdicts(rt.errored, rt.step_event)
        fresh = Verdicts(rt.errored, fresh_event)
        variants: dict[str, Callable[[int], object] | None] = {
            "plain": None,
            "ring": ring.committed,
            "fresh": fresh.committed,
            "record": lambda _: rt.step_event(),
            "record_errored": lambda _: (rt.step_event(), rt.errored()),
            "plain_again": None,  # the same as plain: how far the method alone scatters
        }
        block(model, opt, x, args.steps, None, 0)  # warm-up
        times: dict[str, list[float]] = {name: [] for name in variants}
        step = 1
        for b in range(args.blocks):
            k = b % len(variants)
            names = list(variants)[k:] + list(variants)[:k]
            for name in names:
                times[name].append(block(model, opt, x, args.steps, variants[name], step))
                step += args.steps
        plain = statistics.median(times["plain"])
        row: dict[str, object] = {"params": params, "plain_ms": plain * 1e3}
        for name in list(variants)[1:]:
            t = statistics.median(times[name])
            row |= {f"{name}_ms": t * 1e3, f"{name}_ratio": t / plain}
        torch.cuda.synchronize()
        for name, v in (("ring", ring), ("fresh", fresh)):
            v.settle()
            row |= {f"{name}_verified": v.verified, f"{name}_failed": v.failed}
        row |= {"last_step": step - 1, "device": torch.cuda.get_device_name()}
        print(json.dumps(row), flush=True)
        del model, opt, net
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
