"""A small GPT (byte-level) and its data: the Python standard library's own source text, so
nothing is downloaded. Shared by train_torchrun.py and train_efdl.py."""

from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import Dataset


@dataclass(frozen=True)
class Config:
    layers: int = 4
    width: int = 256
    heads: int = 4
    context: int = 128
    vocab: int = 256  # bytes

    def parameters(self) -> int:
        per_block = 12 * self.width**2 + 13 * self.width
        return self.layers * per_block + (2 * self.vocab + self.context + 2) * self.width


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.norm1, self.norm2 = nn.LayerNorm(cfg.width), nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.up = nn.Linear(cfg.width, 4 * cfg.width)
        self.down = nn.Linear(4 * cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, -1).transpose(1, 3).unbind(2)
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab, cfg.width)
        self.positions = nn.Embedding(cfg.context, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02 / (math.sqrt(2 * cfg.layers) if "down" in name else 1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def shard(model: nn.Module, mesh: DeviceMesh) -> None:
    """FSDP2 as large-model code shards: each block, then the root."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def corpus(megabytes: float) -> torch.Tensor:
    """The first ``megabytes`` of the standard library's .py files, in path order, as bytes."""
    limit, chunks, size = int(megabytes * 2**20), [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "site-packages" in path.parts or size >= limit:
            continue
        chunks.append(path.read_bytes())
        size += len(chunks[-1])
    data = b"".join(chunks)[:limit]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of the corpus: the input and the next byte at each place."""

    def __init__(self, text: torch.Tensor, context: int) -> None:
        self.text, self.context = text, context

    def __len__(self) -> int:
        return (len(self.text) - 1) // self.context

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.text[i * self.context : (i + 1) * self.context + 1]
        return chunk[:-1], chunk[1:]
