"""A clean MLP on the digits: normalized inputs, sizes in multiples of 8, no syncs in the loop."""
# doctor-expect: clean
import torch
from torch import nn

from _gallery_data import digits_tensors, fast_bf16


def main():
    torch.manual_seed(0)
    x, y = digits_tensors()
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    use_amp = fast_bf16()
    batch = 64
    for epoch in range(4):
        perm = torch.randperm(len(x))
        running = torch.zeros(())
        for i in range(0, len(x) - batch + 1, batch):
            idx = perm[i:i + batch]
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_amp):
                loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            running += loss.detach()
        model.eval()
        with torch.inference_mode():
            acc = (model(x).argmax(1) == y).float().mean()
        model.train()
    print(f"final accuracy {acc.item():.3f}, last epoch loss {running.item():.3f}")


if __name__ == "__main__":
    main()
