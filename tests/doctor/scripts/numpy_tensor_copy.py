"""Top-level script; the Dataset copies numpy arrays with torch.tensor."""
# doctor-expect: tensor-copy
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

rng = np.random.default_rng(0)
features = rng.standard_normal((1024, 32)).astype(np.float32)
labels = rng.integers(0, 8, 1024)


class ArrayDataset(Dataset):
    def __len__(self):
        return len(features)

    def __getitem__(self, i):
        return torch.tensor(features[i]), torch.tensor(labels[i])


model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for epoch in range(3):
    for xb, yb in DataLoader(ArrayDataset(), batch_size=64, shuffle=True):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        optimizer.step()
