"""One worker running the job's adam (bias correction, decoupled weight
decay) through the servers beside torch.optim.AdamW on a copy of the same
model and batches; prints the largest relative difference of the weights
(per tensor, in norm) over the steps and exits 1 above the bound.
--diloco: the job's optimizer is diloco, synchronising every 8 steps.
--state_dict: then opt.state_dict() must hold AdamW's exp_avg, exp_avg_sq
and step (within the bound), and a fresh torch.optim.AdamW loading it must
continue as the AdamW that ran all along (20 more steps, within the bound)."""
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
if "--diloco" in sys.argv:
    # DiLoCo with one worker, fp32 outer gradients and replies, outer lr 1
    # and no outer momentum: each sync sets the master to the local model
    # (x_sync - (x_sync - x), a rounding away), so the inner AdamW steps
    # must track torch's AdamW across the syncs.
    opt = onebit_ps.DiLoCo(param_groups(model, lr), lr=lr, sync_every=8, outer_lr=1.0,
                           outer_momentum=0.0)
else:
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
if "--state_dict" in sys.argv:
    mine, theirs = opt.state_dict(), ref.state_dict()
    assert mine["onebit"]["step"] == steps and not mine["onebit"]["frozen"], mine["onebit"]
    assert sorted(mine["onebit"]["server"]) == ["m", "v", "x"], sorted(mine["onebit"]["server"])
    assert len(mine["state"]) == len(theirs["state"]) == 4
    for k, want in theirs["state"].items():
        got = mine["state"][k]
        assert float(got["step"]) == float(want["step"]) == steps
        for key in ("exp_avg", "exp_avg_sq"):
            rel = ((got[key] - want[key]).norm() / want[key].norm()).item()
            print(f"adamw_worker: state {k} {key} relative difference {rel:.3g}", file=sys.stderr)
            # The servers' 1 - beta2 is a float32 difference (0.99998713e-3),
            # torch's a double (1e-3): v differs by 1.3e-5 relative from that
            # alone, which Adam's step mostly cancels (v / (1 - beta2^t)).
            worst = max(worst, rel / 5 if key == "exp_avg_sq" else rel)
    for a, b in zip(mine["param_groups"], theirs["param_groups"]):
        assert (a["lr"], a["betas"], a["eps"], a["weight_decay"]) == \
            (b["lr"], b["betas"], b["eps"], b["weight_decay"]), (a, b)
    # Continue with plain torch: a copy of the job's model and a fresh AdamW
    # loading the state, beside the AdamW that ran all along.
    cont = copy.deepcopy(model)
    with torch.no_grad():
        for p in cont.parameters():
            p.data = p.data.clone()
    fresh = torch.optim.AdamW(param_groups(cont, lr), lr=lr)
    fresh.load_state_dict(mine)
    for t in range(steps, steps + 20):
        x = torch.randn(32, 10, generator=gen)
        y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
        for m, o in ((cont, fresh), (twin, ref)):
            o.zero_grad()
            loss_fn(m(x), y).backward()
            o.step()
    after = 0.0
    for a, b in zip(cont.parameters(), twin.parameters()):
        after = max(after, ((a - b).norm() / b.norm()).item())
    print(f"adamw_worker: continued in torch, largest relative difference {after:.3g}",
          file=sys.stderr)
    worst = max(worst, after)
onebit_ps.finish()
sys.exit(0 if worst <= bound else 1)
