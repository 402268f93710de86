"""A small GPT-style byte-level language model, the standard PyTorch loop.

A decoder-only transformer (causal self-attention, pre-LayerNorm blocks, GELU
MLP) reads bytes of the Debian package `fortunes` (/usr/share/games/fortunes,
about 2.5 MB of English text; every tenth 4 KiB chunk is held out for
validation). AdamW-style param groups (weight decay on the matrices only),
linear warm-up then cosine learning rate, gradient clipping, validation loss.

Over onebit-ps (2 workers x local batch 16, 1 server, 1-bit Adam):
    PYTHONPATH=build/python build/onebit-launch --workers 2 --servers 1 \\
        --optimizer onebit-adam --freeze_step 120 --bias_correction --lr 5e-3 --out runs/gpt \\
        --worker_cmd '/usr/bin/python3 examples/pytorch/gpt.py --steps 600 --lr 5e-3'
(zero-one-adam needs the job's length: add --steps 600 to onebit-launch.)
The same job on one process with torch.optim.AdamW (the same global batches
in the same order, the same schedule):
    /usr/bin/python3 examples/pytorch/gpt.py --local --batch 32 --steps 600 --lr 5e-3
Each onebit-ps worker clips its own gradient (the front has no all-reduce
for a global norm); --split 2 makes the local run clip each half of its
batch the same way, so that onebit-ps adam (--bias_correction) must match it
to rounding. tools/gpt-report runs all the optimizers; docs/transformers.md.
--bench STEPS times the steps against forward + backward (+ clipping) alone
(tools/bench/pytorch_front --model gpt).
The onebit-ps lines are marked; everything else is plain PyTorch.
"""
import argparse
import copy
import itertools
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

SIZES = {  # layers, heads, width, context
    "tiny": (1, 2, 32, 32),
    "default": (2, 4, 64, 64),
    "larger": (4, 4, 128, 128),
}

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--data", default="/usr/share/games/fortunes",
               help="a folder of text files (all read, sorted by name) or one file")
p.add_argument("--size", choices=sorted(SIZES), default="default")
p.add_argument("--steps", type=int, default=600)
p.add_argument("--batch", type=int, default=16, help="sequences per worker (--local: in all)")
p.add_argument("--lr", type=float, default=5e-3, help="peak lr; must equal the job's --lr")
p.add_argument("--warmup", type=int, default=0, help="lr warm-up steps (default: 10 %% of --steps)")
p.add_argument("--min_lr", type=float, default=0.1, help="the cosine's floor, a fraction of --lr")
p.add_argument("--weight_decay", type=float, default=0.1, help="on the matrices only")
p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (0: none)")
p.add_argument("--local", action="store_true", help="torch.optim.AdamW on one process")
p.add_argument("--split", type=int, default=1, metavar="K",
               help="--local: the batch's gradient as K parts, each clipped on its own, then "
                    "averaged, as K onebit-ps workers compute it")
p.add_argument("--out", help="--local: write metrics.csv and summary.json here, as a job's run folder")
p.add_argument("--eval_every", type=int, default=50, metavar="STEPS",
               help="validation loss every STEPS steps and after the last")
p.add_argument("--eval_windows", type=int, default=256, help="validation sequences scored")
p.add_argument("--seed", type=int, default=0)
p.add_argument("--bench", type=int, default=0, metavar="STEPS",
               help="instead of training: time the steps against forward + backward alone")
args = p.parse_args()
if args.split > 1 and not args.local:
    p.error("--split is for --local (a job's workers split the batch themselves)")
n_layer, n_head, width, context = SIZES[args.size]
warmup = args.warmup or max(1, args.steps // 10)


def corpus(path):
    files = [os.path.join(path, f) for f in sorted(os.listdir(path))] if os.path.isdir(path) else [path]
    # fortunes: skip the index files (.dat), the .u8 links and the ASCII art.
    files = [f for f in files if os.path.isfile(f) and not os.path.islink(f)
             and not f.endswith(".dat") and "art" not in os.path.basename(f)]
    if not files:
        sys.exit(f"gpt: no text under {path} (Debian: apt-get install fortunes)")
    data = b"".join(open(f, "rb").read() for f in files)
    chunks = torch.tensor(list(data), dtype=torch.uint8).split(4096)
    # Every tenth chunk held out: validation covers the same topics as training.
    train = torch.cat([c for i, c in enumerate(chunks) if i % 10 != 9]).long()
    val = torch.cat([c for i, c in enumerate(chunks) if i % 10 == 9]).long()
    return train, val


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.ln2 = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, 4 * width)
        self.out = torch.nn.Linear(4 * width, width)
        self.register_buffer("mask", torch.tril(torch.ones(context, context, dtype=torch.bool)))

    def attention(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, n_head, c // n_head).transpose(1, 2)
                   for z in self.qkv(x).split(c, dim=2))
        a = (q @ k.transpose(-2, -1)) / math.sqrt(c // n_head)
        a = a.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(-1)
        return self.proj((a @ v).transpose(1, 2).reshape(b, t, c))

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self, vocab=256):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, width)
        self.pos = torch.nn.Embedding(context, width)
        self.blocks = torch.nn.Sequential(*[Block() for _ in range(n_layer)])
        self.ln = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        for name, q in self.named_parameters():
            if name.endswith("bias"):
                torch.nn.init.zeros_(q)
            elif q.dim() == 2:
                # GPT-2's init: residual projections scaled down by the depth.
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("proj.weight", "out.weight")) else 0.02
                torch.nn.init.normal_(q, 0.0, std)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.blocks(x)))


def param_groups(model):
    """Decay the Linear weights; not biases, LayerNorm weights or embeddings."""
    linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    decay = [q for q in model.parameters() if id(q) in linear]
    rest = [q for q in model.parameters() if id(q) not in linear]
    return [{"params": decay, "weight_decay": args.weight_decay},
            {"params": rest, "weight_decay": 0.0}]


def lr_factor(t):
    """Of step t (from 0): a linear ramp over `warmup` steps, then a cosine to min_lr."""
    if t < warmup:
        return (t + 1) / warmup
    done = min(1.0, (t - warmup) / max(1, args.steps - warmup))
    return args.min_lr + (1 - args.min_lr) * 0.5 * (1 + math.cos(math.pi * done))


def loss_of(model, xy):
    logits = model(xy[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), xy[:, 1:].reshape(-1))


train, val = corpus(args.data)
# Fixed validation windows spread over the held-out text.
starts = torch.linspace(0, len(val) - context - 2, args.eval_windows).long()
val_xy = torch.stack([val[s:s + context + 1] for s in starts])


def evaluate(model):
    """Mean validation loss per byte and next-byte accuracy."""
    model.eval()
    with torch.no_grad():
        total, hits = 0.0, 0
        for xy in val_xy.split(64):
            logits = model(xy[:, :-1])
            y = xy[:, 1:]
            total += F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1), reduction="sum").item()
            hits += (logits.argmax(-1) == y).sum().item()
    model.train()
    n = val_xy[:, 1:].numel()
    return total / n, hits / n


torch.set_num_threads(1)
torch.manual_seed(args.seed)
model = GPT()
twin = copy.deepcopy(model) if args.bench else None  # --bench: no onebit-ps
if args.local:
    rank, world = 0, 1
    opt = torch.optim.AdamW(param_groups(model), lr=args.lr, betas=(0.9, 0.999), eps=1e-8)
else:
    import onebit_ps                                                               # onebit-ps
    onebit_ps.init()                                                               # onebit-ps
    # overlap=False: the gradient is clipped between backward() and step().
    opt = onebit_ps.DistributedOptimizer(param_groups(model), lr=args.lr,          # onebit-ps
                                         overlap=args.clip == 0)
    rank, world = opt.rank, opt.job["workers"]
sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
gen = torch.Generator().manual_seed(args.seed + 1)
params = list(model.parameters())


def batch():
    """This rank's part of the global batch: the same draws on every rank and in --local."""
    at = torch.randint(len(train) - context - 1, (world * args.batch,), generator=gen)
    mine = at[rank * args.batch:(rank + 1) * args.batch]
    return torch.stack([train[s:s + context + 1] for s in mine])


def backward(xy):
    """The loss of xy; its gradient (clipped) in .grad."""
    if args.split <= 1:
        loss = loss_of(model, xy)
        loss.backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(params, args.clip)
        return loss
    # --split K: each part's gradient clipped on its own, then averaged.
    total, losses = [torch.zeros_like(q) for q in params], []
    for part in xy.chunk(args.split):
        opt.zero_grad()
        losses.append(loss_of(model, part))
        losses[-1].backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(params, args.clip)
        for s, q in zip(total, params):
            s.add_(q.grad)
    for s, q in zip(total, params):
        q.grad.copy_(s / args.split)
    return sum(losses) / args.split


def bench_backward(m, xy):
    loss = loss_of(m, xy)
    loss.backward()
    if args.clip:
        torch.nn.utils.clip_grad_norm_(list(m.parameters()), args.clip)
    return loss


if args.bench:  # instead of training (tools/bench/pytorch_front --model gpt)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import front_bench
    front_bench.run("gpt", rank, opt, model, twin, bench_backward,
                    (({"epoch": 0.0}, batch()) for _ in itertools.count()), args.bench, args.local,
                    not args.local and args.clip == 0)
    if not args.local:
        onebit_ps.finish()
    sys.exit()

rows = []  # --local --out: metrics.csv rows
start = time.time()
untrained, _ = evaluate(model)
if rank == 0:
    print(f"gpt: {sum(q.numel() for q in params)} parameters, size {args.size}, {len(train)} training "
          f"bytes, {len(val)} validation; step 0 val_loss {untrained:.6f}", file=sys.stderr, flush=True)
val_loss = acc = None
for t in range(args.steps):
    xy = batch()
    opt.zero_grad()
    loss = backward(xy)
    lr = opt.param_groups[0]["lr"]
    opt.step() if args.local else opt.step(loss=loss, epoch=(t + 1) * world * args.batch
                                           * context / len(train))                # onebit-ps
    sched.step()  # a scheduler's lr reaches the servers with the next step
    if args.local and args.out:
        rows.append([t, "local", loss.item(), time.time() - start, 0, 0, "", "", "",
                     (t + 1) * args.batch * context / len(train)])
    if rank == 0 and ((t + 1) % args.eval_every == 0 or t + 1 == args.steps):
        val_loss, acc = evaluate(model)
        if not args.local:
            opt.report_evaluation(acc, loss=val_loss)                              # onebit-ps
        elif args.out:
            rows[-1] += [val_loss, acc]
        print(f"gpt: step {t + 1} loss {loss.item():.4f} val_loss {val_loss:.6f} accuracy {acc:.4f} "
              f"lr {lr:.3g} ({time.time() - start:.0f} s)", file=sys.stderr, flush=True)
if not args.local:
    onebit_ps.finish()                                                             # onebit-ps
elif args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "metrics.csv"), "w") as f:
        f.write("step,phase,loss,wall_s,bytes_up,bytes_down,step_s,push_s,reply_s,epoch,"
                "test_loss,test_accuracy\n")
        for r in rows:
            f.write(",".join(f"{v:.8g}" if isinstance(v, float) else str(v) for v in r + [""] * (12 - len(r))) + "\n")
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"optimizer": "torch.optim.AdamW", "workers": 1, "split": args.split,
                   "params": sum(q.numel() for q in params), "steps": len(rows),
                   "wall_s": round(time.time() - start, 3), "test_accuracy": acc,
                   "test_loss": val_loss, "untrained_test_loss": untrained}, f, indent=2)
        f.write("\n")
