"""Images fed to the model as raw 0-255 values."""
# doctor-expect: input-not-normalized
import torch
from torch import nn

torch.manual_seed(0)
images = torch.randint(0, 256, (256, 1, 8, 8)).float()
labels = torch.randint(0, 8, (256,))
model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
for epoch in range(3):
    for i in range(0, 256, 32):
        opt.zero_grad()
        nn.functional.cross_entropy(model(images[i:i + 32]), labels[i:i + 32]).backward()
        opt.step()
