"""One worker running the job's adam (bias correction, decoupled weight
decay) through the servers beside torch.optim.AdamW on a copy of the same
model and batches; prints the largest relative difference of the weights
(per tensor, in norm) over the steps and exits 1 above the bound."""
import copy
import sys

import torch

import onebit_ps

steps, bound = int(sys.argv[1]), float(sys.argv[2])
# --groups: biases in a param group of their own without weight decay, as
# BERT recipes do (the servers get them as a weight-decay range).
groups = "--groups" in sys.argv
torch.manual_seed(7)
model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
twin = copy.deepcopy(model)
onebit_ps.init()


def param_groups(m):
    if not groups:
        return m.parameters()
    named = list(m.named_parameters())
    return [{"params": [p for n, p in named if not n.endswith("bias")], "weight_decay": 0.01},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]


opt = onebit_ps.DistributedOptimizer(param_groups(model))
job = opt.job
ref = torch.optim.AdamW(param_groups(twin), lr=job["lr"], betas=(0.9, 0.999), eps=1e-8,
                        weight_decay=0.01)
loss_fn = torch.nn.CrossEntropyLoss()
gen = torch.Generator().manual_seed(3)
worst = 0.0
for t in range(steps):
    x = torch.randn(32, 10, generator=gen)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    for m, o in ((model, opt), (twin, ref)):
        o.zero_grad()
        loss = loss_fn(m(x), y)
        loss.backward()
        o.step() if o is ref else o.step(loss=loss)
    for a, b in zip(model.parameters(), twin.parameters()):
        # Per tensor, ||a - b|| / ||b||: elements near 0 drift apart by rounding alone.
        rel = ((a - b).norm() / b.norm()).item()
        worst = max(worst, rel)
print(f"adamw_worker: {steps} steps, largest relative difference {worst:.3g}", file=sys.stderr)
onebit_ps.finish()
sys.exit(0 if worst <= bound else 1)
