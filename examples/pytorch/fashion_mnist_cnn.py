"""A small conv net on Fashion-MNIST, the standard PyTorch loop.

Over onebit-ps (4 workers x local batch 64, 2 servers, 1-bit Adam, the automatic freeze):
    PYTHONPATH=build/python build/onebit-launch --workers 4 --servers 2 --model external \\
        --optimizer onebit-adam --freeze auto --lr 3e-3 --bias_correction --out runs/cnn \\
        --worker_cmd '/usr/bin/python3 examples/pytorch/fashion_mnist_cnn.py --epochs 10 --lr 3e-3'
0/1 Adam needs the job's length: --optimizer zero-one-adam --steps 234 for one epoch
on 4 workers (60000 / 256); with its defaults it scored 0.847 there, onebit-adam 0.844.
The same script on one process with torch.optim.AdamW, batch 256 (the same global
batches in the same order, the same cosine schedule over the same 2340 steps):
    /usr/bin/python3 examples/pytorch/fashion_mnist_cnn.py --local --epochs 10 --batch 256 --lr 3e-3
Measured on the 2-core machine (busy with other builds): onebit-ps 0.9142 test accuracy
(warm-up until step 700 under the freeze rule of then, 509 s), AdamW 0.9176 (516 s);
tools/demo --pytorch runs both and prints them side by side. --bench STEPS times the
steps against forward + backward alone (tools/bench/pytorch_front).
The onebit-ps lines are marked; everything else is plain PyTorch.
"""
import argparse
import copy
import gzip
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
p.add_argument("--epochs", type=int, default=10)
p.add_argument("--batch", type=int, default=64, help="per worker")
p.add_argument("--lr", type=float, default=3e-3, help="must equal the job's --lr")
p.add_argument("--schedule", choices=["cosine", "constant"], default="cosine")
p.add_argument("--max_train", type=int, default=60000)
p.add_argument("--local", action="store_true", help="torch.optim.AdamW on one process")
p.add_argument("--out", help="--local: write metrics.csv and summary.json here, as a job's run folder")
p.add_argument("--eval_every", type=int, default=0, metavar="STEPS",
               help="score the test set every STEPS steps and after the last (default: every epoch)")
p.add_argument("--no_overlap", action="store_true", help="push at step(), not from backward hooks")
p.add_argument("--bench", type=int, default=0, metavar="STEPS",
               help="time STEPS steps against forward + backward alone, instead of training")
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


def evaluate(model):
    model.eval()
    with torch.no_grad():
        out = torch.cat([model(x) for x in test_x.split(1000)])
    model.train()
    return (out.argmax(1) == test_y).float().mean().item(), F.cross_entropy(out, test_y).item()


torch.set_num_threads(1)
torch.manual_seed(0)
model = Net()
twin = copy.deepcopy(model) if args.bench else None  # --bench: forward + backward with no onebit-ps
if args.local:
    rank, world = 0, 1
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
else:
    import onebit_ps                                                               # onebit-ps
    onebit_ps.init()                                                               # onebit-ps
    opt = onebit_ps.DistributedOptimizer(model, lr=args.lr,                        # onebit-ps
                                         overlap=not args.no_overlap)
    rank, world = opt.rank, opt.job["workers"]

steps_per_epoch = len(train_x) // (world * args.batch)
total_steps = args.bench or args.epochs * steps_per_epoch
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, total_steps) if args.schedule == "cosine" else None
gen = torch.Generator().manual_seed(1)
rows = []  # --local --out: metrics.csv rows


def batches():
    """(epoch, step in epoch, this rank's part of the global batch), the same order on every rank."""
    for epoch in range(math.ceil(total_steps / steps_per_epoch)):
        order = torch.randperm(len(train_x), generator=gen)
        for s in range(steps_per_epoch):
            i = order[(s * world + rank) * args.batch:(s * world + rank + 1) * args.batch]
            yield epoch, s, train_x[i], train_y[i]


def bench_backward(m, xy):
    loss = F.cross_entropy(m(xy[0]), xy[1])
    loss.backward()
    return loss


if args.bench:  # instead of training (tools/bench/pytorch_front)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import front_bench
    front_bench.run("fashion_mnist_cnn", rank, opt, model, twin, bench_backward,
                    (({"epoch": epoch + (s + 1) / steps_per_epoch}, (x, y))
                     for epoch, s, x, y in batches()),
                    total_steps, args.local, not args.no_overlap)
    if not args.local:
        onebit_ps.finish()
    sys.exit()

start = time.time()
model.train()
for epoch, s, x, y in batches():
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    done = epoch + (s + 1) / steps_per_epoch                                  # epochs done
    opt.step() if args.local else opt.step(loss=loss, epoch=done)             # onebit-ps
    if sched:
        sched.step()  # a scheduler's lr reaches the servers with the next step
    if args.local and args.out:
        rows.append([len(rows), "local", loss.item(), time.time() - start, 0, 0, "", "", "", done])
    t = epoch * steps_per_epoch + s + 1  # steps done
    if rank == 0 and (t % args.eval_every == 0 or t == total_steps if args.eval_every
                      else s + 1 == steps_per_epoch):
        acc, test_loss = evaluate(model)
        if not args.local:
            opt.report_evaluation(acc, loss=test_loss)                         # onebit-ps
        if args.local and args.out:
            rows[-1] += [test_loss, acc]
        print(f"fashion_mnist_cnn: step {t} epoch {done:.2f} loss {loss.item():.4f} test loss "
              f"{test_loss:.4f} accuracy {acc:.4f} ({time.time() - start:.0f} s)",
              file=sys.stderr, flush=True)
if not args.local:
    onebit_ps.finish()                                                             # onebit-ps
elif args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "metrics.csv"), "w") as f:
        f.write("step,phase,loss,wall_s,bytes_up,bytes_down,step_s,push_s,reply_s,epoch,"
                "test_loss,test_accuracy\n")
        for r in rows:
            f.write(",".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in r + [""] * (12 - len(r))) + "\n")
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"optimizer": "torch.optim.AdamW", "workers": 1, "params": sum(
            q.numel() for q in model.parameters()), "steps": len(rows), "epochs": args.epochs,
            "wall_s": round(time.time() - start, 3), "test_accuracy": acc, "test_loss": test_loss},
            f, indent=2)
        f.write("\n")
