"""A small transformer encoder classifier: nn.MultiheadAttention uses out_proj's weights without calling
out_proj.forward, and those weights get gradients: nothing here is unused."""
# doctor-expect: clean
import torch
from torch import nn

from _gallery_data import fast_bf16


class Classifier(nn.Module):
    def __init__(self, vocab=256, d=64, classes=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=128, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, ids):
        return self.head(self.encoder(self.emb(ids)).mean(1))


torch.manual_seed(0)
model = Classifier()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids, labels = torch.randint(0, 256, (512, 16)), torch.randint(0, 8, (512,))
use_amp = fast_bf16()
for epoch in range(3):
    perm = torch.randperm(len(ids))
    for i in range(0, len(ids), 32):
        idx = perm[i:i + 32]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_amp):
            loss = nn.functional.cross_entropy(model(ids[idx]), labels[idx])
        loss.backward()
        opt.step()
