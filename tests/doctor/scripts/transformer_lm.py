"""A small GPT-style token language model whose vocabulary (997) is not a multiple of 8 (T24).

Every hidden size and the batch are multiples of 8; only the LM head over the vocabulary is
not: its matmul (and its backward) is the widest in the model.
"""
# doctor-expect: size-not-multiple-of-8
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, T, D = 997, 32, 64


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x):
        B = x.shape[0]
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, 4, D // 4).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, D), nn.Embedding(T, D)
        self.block, self.ln = Block(), nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied, as GPT-2 does
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.block(x)))


def main():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    stream = torch.randint(0, VOCAB, (4000,), generator=g)
    stream[1::2] = (stream[::2] * 7 + 3) % VOCAB  # every second token follows from the one before
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(40):
        starts = torch.randint(0, len(stream) - T - 1, (16,), generator=g)
        idx = stream[starts[:, None] + torch.arange(T + 1)]
        x, y = idx[:, :-1], idx[:, 1:]
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
    print(f"loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
