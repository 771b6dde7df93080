"""Validation after each epoch, in eval mode but with autograd still recording."""
# doctor-expect: eval-grad-enabled
import torch
from torch import nn

torch.manual_seed(0)
X, Y = torch.randn(256, 16), torch.randint(0, 4, (256,))
Xv, Yv = torch.randn(256, 16), torch.randint(0, 4, (256,))
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


def evaluate():
    model.eval()
    correct = torch.zeros(())
    for i in range(0, len(Xv), 64):
        out = model(Xv[i:i + 64])                 # no torch.no_grad() here
        correct += (out.argmax(1) == Yv[i:i + 64]).sum()
    model.train()
    return correct


for epoch in range(6):
    for i in range(0, len(X), 64):
        opt.zero_grad()
        nn.functional.cross_entropy(model(X[i:i + 64]), Y[i:i + 64]).backward()
        opt.step()
    evaluate()
