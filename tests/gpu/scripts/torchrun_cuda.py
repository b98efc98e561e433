"""A plain torchrun DDP script, as GPU users write them: its device from LOCAL_RANK."""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
dist.init_process_group("nccl")
model = DistributedDataParallel(torch.nn.Linear(16, 4).cuda(), device_ids=[local_rank])
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    opt.zero_grad()
    model(torch.randn(8, 16, device="cuda")).sum().backward()
    opt.step()
torch.cuda.synchronize()
print(f"trained on {torch.cuda.get_device_name()} as cuda:{local_rank}", flush=True)
dist.destroy_process_group()
