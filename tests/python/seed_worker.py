"""A worker that trains steps [START, STOP) of a fixed problem (the batch of
step t and rank r depends on t and r only), optionally starting from a file
that an earlier job saved (--load: the model's weights, then
opt.load_state_dict of the saved opt.state_dict()) and saving one at its end
(--save, rank 0). Writes its parameters after the last step to
DIR/params-<rank>.f32 (--dump DIR), so that a job resumed through
load_state_dict can be compared bit for bit with one that ran throughout.

--torch K: first K steps of torch.optim.AdamW on one process (every rank
the same), then the job continues from its model and state beside that
AdamW; prints the largest relative difference and exits 1 above --bound.
--errors: load_state_dict's refusals, each by name, then two steps."""
import argparse
import copy
import os
import signal
import sys
import time

import torch

import onebit_ps
from local_servers import signal_server

p = argparse.ArgumentParser()
p.add_argument("start", type=int)
p.add_argument("stop", type=int)
p.add_argument("--load")
p.add_argument("--save")
p.add_argument("--dump")
p.add_argument("--torch", type=int, default=0)
p.add_argument("--bound", type=float, default=1e-5)
p.add_argument("--errors", action="store_true")
p.add_argument("--kill_server_at", type=int, default=-1,
               help="rank 0 kills server 0 (SIGKILL) before step T; the launcher starts it "
                    "again and the job rolls back to its last checkpoint")
args = p.parse_args()

torch.manual_seed(7)
model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
loss_fn = torch.nn.CrossEntropyLoss()
onebit_ps.init()
rank = onebit_ps.rank()


def batch(t, r):
    g = torch.Generator().manual_seed(1000 * t + r)
    x = torch.randn(32, 10, generator=g)
    return x, (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()


def groups(m):
    named = list(m.named_parameters())
    return [{"params": [q for n, q in named if not n.endswith("bias")], "weight_decay": 0.01},
            {"params": [q for n, q in named if n.endswith("bias")], "weight_decay": 0.0}]


lr = 0.001  # the job's
twin = ref = None
if args.torch:
    twin = copy.deepcopy(model)
    ref = torch.optim.AdamW(groups(twin), lr=lr, weight_decay=0.01)
    for t in range(args.torch):
        ref.zero_grad()
        loss_fn(twin(batch(t, 0)[0]), batch(t, 0)[1]).backward()
        ref.step()
    model.load_state_dict(twin.state_dict())
saved = torch.load(args.load) if args.load else None
if saved:
    model.load_state_dict(saved["model"])
opt = onebit_ps.DistributedOptimizer(groups(model), lr=lr)


def refused(state, want):
    try:
        opt.load_state_dict(state)
    except onebit_ps.OnebitError as e:
        assert want in str(e), (want, str(e))
        print(f"seed_worker: refused: {e}", file=sys.stderr)
        return
    sys.exit(f"seed_worker: load_state_dict should have been refused with {want!r}")


if args.errors:
    good = torch.optim.AdamW(groups(copy.deepcopy(model)), lr=lr, weight_decay=0.01)
    for q in good.param_groups[0]["params"] + good.param_groups[1]["params"]:
        q.grad = torch.ones_like(q)
    good.step()
    sd = good.state_dict()
    if opt.job["optimizer"] not in ("adam", "onebit-adam", "naive-onebit-adam"):
        refused(sd, f"--optimizer {opt.job['optimizer']} keeps a state that is not Adam's")
    else:
        bad = copy.deepcopy(sd)
        bad["state"][1]["exp_avg"] = torch.zeros(16, 3)
        refused(bad, "exp_avg of parameter 1 has shape (16, 3), the parameter (3, 16)")
        bad = copy.deepcopy(sd)
        bad["param_groups"][0]["betas"] = (0.9, 0.95)
        refused(bad, "param group 0 has beta2 0.95, the job 0.999")
        bad = copy.deepcopy(sd)
        bad["param_groups"][1]["weight_decay"] = 0.01
        refused(bad, "param group 1 has weight_decay 0.01, this optimizer's group 0.0")
        bad = copy.deepcopy(sd)
        bad["state"][2]["exp_avg_sq"][0] = -1.0
        refused(bad, "SeedOptimizerState(): v[208] is -1 (want finite, >= 0)")  # 0.bias[0]
        bad = copy.deepcopy(sd)
        bad["state"][3]["step"] = torch.tensor(5.0)
        refused(bad, "parameter 3 is at step 5.0, the others at 1.0")
        bad = copy.deepcopy(sd)
        del bad["state"][0]
        refused(bad, "parameter 0 has no exp_avg")
        opt.load_state_dict(sd)  # the good one, after the refusals
        print("seed_worker: seeded", file=sys.stderr)

if saved:
    opt.load_state_dict(saved["opt"])
if ref is not None:
    opt.load_state_dict(ref.state_dict())
worst = 0.0




t = args.start
while t < args.stop:
    if t == args.kill_server_at and rank == 0:
        time.sleep(1.5)  # the checkpoints of the steps before written: the launcher restarts
        signal_server(0, signal.SIGKILL)
        args.kill_server_at = -1
    x, y = batch(t, rank)
    opt.zero_grad()
    try:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step(loss=loss)
    except onebit_ps.RolledBack as e:
        print(f"seed_worker: step {t}: {e}", file=sys.stderr)
        t = args.start + opt.steps_done
        continue
    if ref is not None:
        ref.zero_grad()
        loss_fn(twin(batch(t, 0)[0]), batch(t, 0)[1]).backward()
        ref.step()
        for a, b in zip(model.parameters(), twin.parameters()):
            worst = max(worst, ((a - b).norm() / b.norm()).item())
    t += 1
if args.errors:
    refused(opt.state_dict(), "only before the job's first step")
if ref is not None:
    print(f"seed_worker: {args.torch} steps in torch, then {args.stop - args.start} over the "
          f"servers: largest relative difference {worst:.3g}", file=sys.stderr)
    sd = opt.state_dict()
    assert float(sd["state"][0]["step"]) == args.torch + args.stop - args.start, sd["state"][0]
    assert sd["onebit"]["bias_steps"] == args.torch, sd["onebit"]
if args.save and rank == 0:
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, args.save)
if args.dump:
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    flat.numpy().tofile(os.path.join(args.dump, f"params-{rank}.f32"))
onebit_ps.finish()
sys.exit(0 if worst <= args.bound else 1)
