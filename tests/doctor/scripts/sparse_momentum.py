"""A bag-of-words text classifier with a sparse embedding, stepped by SGD with momentum (its buffer never
coalesces: the optimizer's step grows every step)."""
# doctor-expect: sparse-momentum
import torch
from torch import nn

torch.manual_seed(0)
VOCAB, WORDS, N = 5000, 24, 64
tokens = torch.randint(0, VOCAB, (N * 40, WORDS))
labels = tokens[:, 0] % 4
model = nn.Sequential(nn.EmbeddingBag(VOCAB, 64, mode="mean", sparse=True), nn.Linear(64, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
for epoch in range(2):
    for i in range(0, len(tokens), N):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(tokens[i:i + N]), labels[i:i + N])
        loss.backward()
        opt.step()
