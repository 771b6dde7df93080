"""Per-sample float64 rows turned into tensors with torch.tensor inside a Dataset that DataLoader
workers run: the loop never sees the copies, only `dataset[i]` does."""
# doctor-expect: tensor-copy
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Rows(Dataset):
    def __init__(self, n=1024):
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((n, 24))          # float64, as numpy makes it
        self.y = rng.integers(0, 3, n)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return torch.tensor(self.x[i], dtype=torch.float32), torch.tensor(self.y[i])


if __name__ == "__main__":
    model = nn.Sequential(nn.Linear(24, 48), nn.ReLU(), nn.Linear(48, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(Rows(), batch_size=32, shuffle=True, num_workers=1)
    for epoch in range(3):
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
