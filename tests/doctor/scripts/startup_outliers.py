"""In-memory data through one DataLoader worker that restarts at every epoch: one slow step per epoch
(the worker's start-up), every other step waits for nothing. The median step is not data-bound."""
# doctor-expect: stopped
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from _gallery_data import digits_tensors, fast_bf16


class Digits(Dataset):
    def __init__(self):
        self.x, self.y = digits_tensors()
        self.x, self.y = self.x[:768], self.y[:768]

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(Digits(), batch_size=96, shuffle=True, num_workers=1)  # 8 batches, workers restart
    use_amp = fast_bf16()
    for epoch in range(6):
        for x, y in loader:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_amp):
                loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()


if __name__ == "__main__":
    main()
