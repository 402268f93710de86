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
# --lr_groups: also their own lrs (the first layer at 0.3x the job's lr, the
# biases at 2.5x: lr-scale ranges on the servers) under a warm-up schedule
# that moves every group by one factor.
lr_groups = "--lr_groups" in sys.argv
groups = "--groups" in sys.argv or lr_groups
torch.manual_seed(7)
model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
twin = copy.deepcopy(model)
onebit_ps.init()


def param_groups(m, lr):
    if not groups:
        return m.parameters()
    named = list(m.named_parameters())
    weights = [p for n, p in named if not n.endswith("bias")]
    biases = [p for n, p in named if n.endswith("bias")]
    if not lr_groups:
        return [{"params": weights, "weight_decay": 0.01}, {"params": biases, "weight_decay": 0.0}]
    return [{"params": weights[1:], "weight_decay": 0.01},
            {"params": weights[:1], "weight_decay": 0.01, "lr": 0.3 * lr},
            {"params": biases, "weight_decay": 0.0, "lr": 2.5 * lr}]


lr = 0.001  # the job's (onebit-launch --lr)
opt = onebit_ps.DistributedOptimizer(param_groups(model, lr), lr=lr)
job = opt.job
ref = torch.optim.AdamW(param_groups(twin, lr), lr=lr, betas=(0.9, 0.999), eps=1e-8,
                        weight_decay=0.01)
schedules = []
if lr_groups:
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda t: min(1.0, (t + 1) / 20))
                 for o in (opt, ref)]
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
    for s in schedules:
        s.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        # Per tensor, ||a - b|| / ||b||: elements near 0 drift apart by rounding alone.
        rel = ((a - b).norm() / b.norm()).item()
        worst = max(worst, rel)
print(f"adamw_worker: {steps} steps, largest relative difference {worst:.3g}", file=sys.stderr)
onebit_ps.finish()
sys.exit(0 if worst <= bound else 1)
