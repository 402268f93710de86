"""A small conv net on Fashion-MNIST, the standard PyTorch loop.

Over onebit-ps (4 workers, 2 servers, 1-bit Adam):
    PYTHONPATH=build/python build/onebit-launch --workers 4 --servers 2 --model external \\
        --optimizer onebit-adam --freeze auto --lr 1e-3 --bias-correction \\
        --worker-cmd '/usr/bin/python3 examples/pytorch/fashion_mnist_cnn.py --epochs 4'
The same script on one process with torch.optim.AdamW, for comparison:
    /usr/bin/python3 examples/pytorch/fashion_mnist_cnn.py --local --epochs 4 --batch 256
The onebit-ps lines are marked; everything else is plain PyTorch.
"""
import argparse
import gzip
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
p.add_argument("--epochs", type=int, default=4)
p.add_argument("--batch", type=int, default=64, help="per worker")
p.add_argument("--max_train", type=int, default=60000)
p.add_argument("--local", action="store_true", help="torch.optim.AdamW on one process")
args = p.parse_args()


def idx(name, offset):
    with gzip.open(os.path.join(args.data, name)) as f:
        return np.frombuffer(f.read(), dtype=np.uint8, offset=offset)


train_x = torch.tensor(idx("train-images-idx3-ubyte.gz", 16), dtype=torch.float32).view(-1, 1, 28, 28)[:args.max_train] / 255
train_y = torch.tensor(idx("train-labels-idx1-ubyte.gz", 8), dtype=torch.long)[:args.max_train]
test_x = torch.tensor(idx("t10k-images-idx3-ubyte.gz", 16), dtype=torch.float32).view(-1, 1, 28, 28) / 255
test_y = torch.tensor(idx("t10k-labels-idx1-ubyte.gz", 8), dtype=torch.long)


class Net(torch.nn.Module):  # ~184 k parameters
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 32, 5)
        self.conv2 = torch.nn.Conv2d(32, 64, 5)
        self.fc1 = torch.nn.Linear(64 * 4 * 4, 128)
        self.fc2 = torch.nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


torch.set_num_threads(1)
torch.manual_seed(0)
model = Net()
if args.local:
    rank, world = 0, 1
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
else:
    import onebit_ps                                  # onebit-ps
    onebit_ps.init()                                  # onebit-ps
    opt = onebit_ps.DistributedOptimizer(model)       # onebit-ps
    rank, world = opt.rank, opt.job["workers"]

steps_per_epoch = len(train_x) // (world * args.batch)
gen = torch.Generator().manual_seed(1)
start = time.time()
for epoch in range(args.epochs):
    order = torch.randperm(len(train_x), generator=gen)  # the same on every rank
    model.train()
    for s in range(steps_per_epoch):
        i = order[(s * world + rank) * args.batch:(s * world + rank + 1) * args.batch]
        opt.zero_grad()
        loss = F.cross_entropy(model(train_x[i]), train_y[i])
        loss.backward()
        opt.step() if args.local else opt.step(loss=loss)
    if rank == 0:
        model.eval()
        with torch.no_grad():
            acc = (model(test_x).argmax(1) == test_y).float().mean().item()
        print(f"fashion_mnist_cnn: epoch {epoch + 1} loss {loss.item():.4f} test accuracy "
              f"{acc:.4f} ({time.time() - start:.0f} s)", file=sys.stderr, flush=True)
if not args.local:
    onebit_ps.finish()                                # onebit-ps
