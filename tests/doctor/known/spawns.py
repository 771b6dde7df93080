"""A script that trains in processes it starts itself, as PyTorch's DDP tutorial does with mp.spawn."""
import torch
import torch.multiprocessing as mp


def train(rank, world_size):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(100):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    mp.spawn(train, args=(2,), nprocs=2)
    raise SystemExit("the processes ran: the doctor should have stopped the script before they started")
