"""Training inside a class; the loop reads the loss and predictions back every step."""
# doctor-expect: host-sync
import torch
from torch import nn


class Trainer:
    def __init__(self):
        torch.manual_seed(0)
        self.x = torch.randn(2048, 24)
        self.y = (self.x[:, 0] > 0).long()
        self.model = nn.Sequential(nn.Linear(24, 64), nn.ReLU(), nn.Linear(64, 2))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.history = []

    def train_step(self, xb, yb):
        self.opt.zero_grad()
        out = self.model(xb)
        loss = nn.functional.cross_entropy(out, yb)
        loss.backward()
        self.opt.step()
        self.history.append(loss.item())            # a host-device sync per step on a GPU
        correct = (out.argmax(1) == yb).tolist()    # and another one
        return sum(correct)

    def fit(self, epochs=3, batch=64):
        for _ in range(epochs):
            perm = torch.randperm(len(self.x))
            for i in range(0, len(self.x), batch):
                idx = perm[i:i + batch]
                self.train_step(self.x[idx], self.y[idx])


if __name__ == "__main__":
    Trainer().fit()
