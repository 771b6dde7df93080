"""A custom module whose convolutions keep a bias in front of BatchNorm."""
# doctor-expect: conv-bias-before-bn, channels-last
import torch
from torch import nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32, 8)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(x, 2)
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean((2, 3)))


def train():
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    data = [(torch.randn(16, 3, 16, 16), torch.randint(0, 8, (16,))) for _ in range(6)]
    for epoch in range(3):
        for x, y in data:
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()


if __name__ == "__main__":
    train()
