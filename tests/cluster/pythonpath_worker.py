"""A PyTorch worker run by launch_test through onebit-launch --worker_cmd
with no PYTHONPATH and no --model: the launcher makes the job external and
puts its own onebit_ps package first on PYTHONPATH. Says where onebit_ps
came from, then trains a 4-parameter linear model for 3 steps."""
import sys

import torch

import onebit_ps

print(f"pythonpath_worker: onebit_ps from {onebit_ps.__file__}", file=sys.stderr)
onebit_ps.init()
torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
opt = onebit_ps.DistributedOptimizer(model)
x = torch.ones(8, 3)
for _ in range(3):
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step(loss=loss)
onebit_ps.finish()
