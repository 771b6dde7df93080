"""A plain training script with parallel="fsdp2": under `torchspeed launch` it trains sharded, checkpoints
with DCP and exports the weights; nothing in it knows about processes."""

import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchspeed

torch.set_num_threads(1)
out = sys.argv[1]
g = torch.Generator().manual_seed(0)
x, y = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 16), *[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2)],
                      nn.Linear(16, 3))  # two repeated stages: the blocks fit finds
steps = []
result = torchspeed.fit(model, DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True), epochs=2,
                        optimizer="adamw", lr=1e-2, parallel="fsdp2", compile=False, progress=False,
                        checkpoint_dir=os.path.join(out, "ckpt"), on_checkpoint=lambda p, s: steps.append(s))
if torchspeed.is_rank_zero():
    torchspeed.export_checkpoint(os.path.join(out, "ckpt"), os.path.join(out, "model.pt"))
with open(os.path.join(out, f"rank{os.environ.get('RANK', 'none')}.json"), "w") as f:
    json.dump({"steps": result.steps, "checkpoints": steps, "decisions": {k: str(v) for k, v in
                                                                          result.decisions.items()}}, f)
