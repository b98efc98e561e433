"""Train a small GPT on the standard library's source with FSDP2: the efdl version.

    efdl-run --standalone --nproc-per-node 2 examples/gpt/train_efdl.py

train_torchrun.py plus the efdl change: when nodes join or leave, the workers are not
restarted; they pause at a step boundary and the model's shards are laid out anew over the
new world, in place (docs/fsdp.md). The checkpoint (--checkpoint) still serves a restart of
the whole job, which resumes at the start of the epoch it was in.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils.data import DataLoader

import efdl

sys.path.insert(0, os.path.dirname(__file__))
from model import GPT, Config, Windows, corpus, shard


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="per worker")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=0, help="stop after this many (0: all)")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--data-mb", type=float, default=4.0)
    parser.add_argument("--checkpoint", default="", help="a directory (none by default)")
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--log-every", type=int, default=10, help="steps between loss lines")
    args = parser.parse_args()

    efdl.init_process_group("gloo")
    cfg = Config(args.layers, args.width, args.heads, args.context)
    torch.manual_seed(0)
    model = efdl.fully_shard(GPT(cfg), shard)  # efdl shards it again on each new world
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    data = Windows(corpus(args.data_mb), cfg.context)
    sampler = efdl.ElasticSampler(data, batch_size=args.batch, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler)
    progress = {"epoch": 0, "step": 0, "samples": 0}  # samples: of the epoch, all ranks
    if args.checkpoint and os.path.exists(os.path.join(args.checkpoint, ".metadata")):
        model_sd, optim_sd = get_state_dict(model, optimizer)
        snapshot = {"model": model_sd, "optimizer": optim_sd, "progress": progress}
        dcp.load(snapshot, checkpoint_id=args.checkpoint)
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

    def save(model: torch.nn.Module) -> None:
        if args.checkpoint:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            snapshot = {"model": model_sd, "optimizer": optim_sd, "progress": progress}
            dcp.save(snapshot, checkpoint_id=args.checkpoint)

    state = efdl.elastic_state(model, optimizer, sampler, progress=progress)

    @efdl.elastic(state)
    def train(state: efdl.ElasticState) -> None:
        t0, model, progress = time.time(), state.model, state.progress
        for epoch in range(progress["epoch"], args.epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                x, y = x.to(efdl.device()), y.to(efdl.device())  # where efdl shards: a GPU if any
                loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                progress["step"] += 1
                progress["samples"] += args.batch * dist.get_world_size()
                step, world = progress["step"], dist.get_world_size()
                if dist.get_rank() == 0 and step % args.log_every == 0:
                    loss_, seconds = round(loss.item(), 4), round(time.time() - t0, 2)
                    print(
                        json.dumps(
                            {
                                "step": step,
                                "epoch": epoch,
                                "world": world,
                                "loss": loss_,
                                "seconds": seconds,
                                "t": time.time(),
                            }
                        ),
                        flush=True,
                    )
                if step % args.save_every == 0:
                    save(model)
                if step == args.steps:
                    break
                state.commit()
            else:
                progress["epoch"], progress["samples"] = epoch + 1, 0
            save(model)
            if progress["step"] == args.steps:
                break

    train(state)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
