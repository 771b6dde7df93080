"""A plain training script: nothing in it knows about processes. `torchspeed launch` makes it DDP."""

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
x, y = torch.randn(96, 3, 8, 8, generator=g), torch.randint(0, 4, (96,), generator=g)
torch.manual_seed(int(os.environ.get("RANK", 0)))  # different initial weights per rank: DDP must sync them
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                      nn.Flatten(), nn.Linear(8, 4))
result = torchspeed.fit(model, DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True), epochs=2,
                        val_loader=DataLoader(TensorDataset(x[:40], y[:40]), batch_size=16), compile=False,
                        progress=True, grad_accum=2, out_dir=os.path.join(out, "metrics"))
rank = os.environ.get("RANK", "none")
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"world": int(os.environ.get("WORLD_SIZE", 1)), "threads": torch.get_num_threads(),
               "steps": result.steps, "decisions": result.decisions, "history": result.history,
               "weights": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()}, f)
