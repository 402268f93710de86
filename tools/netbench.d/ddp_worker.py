"""One rank of PyTorch DistributedDataParallel over gloo with torch.optim.AdamW:
the DDP side of tools/netbench, started once per emulated host.

    RANK=r WORLD_SIZE=n MASTER_ADDR=a MASTER_PORT=p GLOO_SOCKET_IFNAME=nb0 \\
        /usr/bin/python3 tools/netbench.d/ddp_worker.py --model mlp --steps 2340 \\
        --hook none|fp16|powersgd --out DIR

Models:
  mlp        784-256-128-10 (ReLU, softmax cross-entropy) on Fashion-MNIST, as
             onebit-ps's built-in mlp (models/mlp_model.cc): the same initial
             weights (its SplitMix64 stream, U(±sqrt(6/fan_in)), zero biases), the
             same data order (its EpochPermutation per epoch, rank r's local batch
             at r * batch of each global batch), the same local batch, x / 255.
  cnn        the conv net of examples/pytorch/fashion_mnist_cnn.py (~184 k
             parameters), as that script trains it over onebit-ps: its own class
             Net (compiled from the script's source), the same initial weights
             (torch.manual_seed(0)), the same data order (a
             torch.Generator seeded 1 draws a randperm per epoch; rank r's batch at
             (s * world + r) * batch), the cosine schedule over the whole run
             (CosineAnnealingLR), --lr 3e-3 by netbench.
  gpt        the byte-level GPT of examples/pytorch/gpt.py on Debian's fortunes
             (--gpt_size, default its "default": 136 960 parameters), as that
             script trains it over onebit-ps: its own classes, functions and
             argument defaults (its statements that define them, compiled from
             the script's source, with --size, --steps, --batch, --lr and
             --eval_every passed to its parser), the same initial weights
             (torch.manual_seed(seed) before GPT()), the same batches (its
             batch(): one generator seeded seed + 1 draws the global batch's
             windows, rank r takes the r-th --batch of them), AdamW with its
             param_groups (weight decay 0.1 on the Linear weights only), its
             warm-up + cosine lr_factor (LambdaLR), its clip of the gradient
             norm at 1.0, and its evaluate(): the validation loss (and next-byte
             accuracy) in metrics.csv's test_loss (test_accuracy) columns. One
             difference: DDP clips the averaged gradient, each onebit-ps worker
             (the PyTorch front has no all-reduce) its own before pushing it.
  synthetic  --dim parameters as --matrices square-ish matrices (PowerSGD compresses
             only matrices), loss sum(w * c) with a fixed random c per rank: the
             gradient is c, a 25 M-float copy, so the step is communication.

Every rank writes DIR/rank<r>.csv (step, wall_s, its NIC's tx and rx bytes
during the step: GLOO_SOCKET_IFNAME's counters under /sys/class/net, which
`ip netns exec` mounts for the namespace; the seconds of forward + backward
with the allreduce (gpt: and the clipping), and of AdamW's step); rank 0
also writes DIR/metrics.csv in the columns of a onebit-ps run folder
(docs/design.md §2; bytes are rank 0's NIC times the world size) with its
test score every --eval_every steps (gpt: its validation loss and next-byte
accuracy), and DIR/summary.json.
"""
import argparse
import ast
import gzip
import itertools
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--model", choices=["mlp", "cnn", "gpt", "synthetic"], default="mlp")
p.add_argument("--steps", type=int, required=True)
p.add_argument("--batch", type=int, default=64, help="per rank")
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--seed", type=int, default=1)
p.add_argument("--hook", choices=["none", "fp16", "powersgd"], default="none")
p.add_argument("--powersgd_rank", type=int, default=2)
p.add_argument("--powersgd_start", type=int, default=2,
               help="PowerSGD's start_powerSGD_iter: vanilla allreduce before (>= 2)")
p.add_argument("--eval_every", type=int, default=0,
               help="mlp, cnn: score the test set every N steps; gpt: the validation loss")
p.add_argument("--cosine", action="store_true", help="cnn: the cosine lr schedule over --steps")
p.add_argument("--gpt_size", default="default", help="gpt: the example's --size")
p.add_argument("--max_train", type=int, default=0)
p.add_argument("--max_test", type=int, default=0)
p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
p.add_argument("--dim", type=int, default=25165824, help="synthetic: parameters")
p.add_argument("--matrices", type=int, default=24, help="synthetic: as this many matrices")
p.add_argument("--nic", default=os.environ.get("GLOO_SOCKET_IFNAME", ""))
p.add_argument("--out", required=True)
p.add_argument("--bench", type=int, default=0, metavar="STEPS",
               help="cnn, gpt: time STEPS steps against forward + backward alone, as the "
                    "examples' --bench (tools/bench/pytorch_front's DDP baseline), instead of "
                    "training")
args = p.parse_args()

torch.set_num_threads(1)
rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
os.makedirs(args.out, exist_ok=True)

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def mix(z):
    """models/rng.h SplitMix64Mix on a numpy uint64 array (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def mix1(z):
    return int(mix(np.array([z & M64], dtype=np.uint64))[0])


class Stream:
    """models/rng.h SplitMix64: value k is Mix(state0 + (k + 1) * golden)."""

    def __init__(self, state):
        self.state = state & M64
        self.used = 0

    def next(self, n):
        k = np.arange(self.used + 1, self.used + n + 1, dtype=np.uint64)
        self.used += n
        with np.errstate(over="ignore"):
            return mix(np.uint64(self.state) + k * np.uint64(GOLDEN))


def epoch_permutation(n, seed, epoch):
    """models/dataset.cc EpochPermutation: Fisher-Yates, j = Uniform(i) for i = n .. 2."""
    state = mix1(seed ^ 0x3C6EF372FE94F82B) ^ mix1(epoch + 0xA54FF53A5F1D36F1)
    bounds = np.arange(n, 1, -1, dtype=np.uint64)
    draws = Stream(state).next(len(bounds))
    limits = np.uint64(M64) - np.uint64(M64) % bounds
    p = list(range(n))
    if bool((draws < limits).all()):
        js = (draws % bounds).tolist()
    else:  # a rejected draw (odds ~n / 2^64 each): redo it one draw at a time
        rng, js = Stream(state), []
        for i in range(n, 1, -1):
            while True:
                r = int(rng.next(1)[0])
                if r < M64 - M64 % i:
                    break
            js.append(r % i)
    for i, j in zip(range(n, 1, -1), js):
        p[i - 1], p[j] = p[j], p[i - 1]
    return np.array(p, dtype=np.int64)


def nic_bytes():
    if not args.nic:
        return 0, 0
    base = f"/sys/class/net/{args.nic}/statistics/"
    with open(base + "tx_bytes") as f:
        tx = int(f.read())
    with open(base + "rx_bytes") as f:
        rx = int(f.read())
    return tx, rx


def example_net():
    """The class Net of examples/pytorch/fashion_mnist_cnn.py itself, not a copy
    (importing the script would run it): its definition, compiled alone."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples",
                        "pytorch", "fashion_mnist_cnn.py")
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Net"), None)
    if node is None:
        sys.exit(f"ddp_worker: no class Net in {path}")
    scope = {"torch": torch, "F": F}
    exec(compile(ast.Module(body=[node], type_ignores=[]), path, "exec"), scope)
    return scope["Net"]


def example_gpt(argv):
    """The definitions of examples/pytorch/gpt.py itself, not copies (importing
    the script would train): its argument parser (every top-level statement
    before `args = p.parse_args()`), given argv; then, in the script's order,
    only the statements that define the names below (the model's size, the
    lr warm-up, the corpus and validation windows, the batch generator, and
    the classes and functions). Returns their scope; the caller sets rank and
    world before calling batch()."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples",
                        "pytorch", "gpt.py")
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    assigned = {"n_layer", "n_head", "width", "context", "warmup", "train", "val", "starts",
                "val_xy", "gen"}
    defined = {"corpus", "Block", "GPT", "param_groups", "lr_factor", "loss_of", "evaluate",
               "batch"}

    def targets(node):
        names = set()
        for t in node.targets:
            names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        return names

    parse = next((i for i, n in enumerate(tree.body) if isinstance(n, ast.Assign)
                  and targets(n) == {"args"}), None)
    if parse is None:
        sys.exit(f"ddp_worker: no `args = p.parse_args()` in {path}")
    head = tree.body[:parse]
    tail = [n for n in tree.body[parse + 1:]
            if (isinstance(n, ast.Assign) and targets(n) <= assigned)
            or (isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in defined)]
    scope = {"__name__": "gpt_example", "__doc__": ast.get_docstring(tree, clean=False) or ""}
    exec(compile(ast.Module(body=head, type_ignores=[]), path, "exec"), scope)
    scope["args"] = scope["p"].parse_args(argv)
    exec(compile(ast.Module(body=tail, type_ignores=[]), path, "exec"), scope)
    missing = sorted((assigned | defined) - set(scope))
    if missing:
        sys.exit(f"ddp_worker: {path} no longer defines {', '.join(missing)} at its top level")
    return scope


def idx(name, offset):
    with gzip.open(os.path.join(args.data, name)) as f:
        return np.frombuffer(f.read(), dtype=np.uint8, offset=offset)


if args.model == "mlp":
    layers = [784, 256, 128, 10]
    tx = idx("train-images-idx3-ubyte.gz", 16).reshape(-1, 784)
    ty = idx("train-labels-idx1-ubyte.gz", 8)
    if args.max_train:
        tx, ty = tx[:args.max_train], ty[:args.max_train]
    ex = idx("t10k-images-idx3-ubyte.gz", 16).reshape(-1, 784)
    ey = idx("t10k-labels-idx1-ubyte.gz", 8)
    if args.max_test:
        ex, ey = ex[:args.max_test], ey[:args.max_test]
    train_x = torch.from_numpy(tx.copy())  # uint8; scaled per batch (x / 255 in fp32)
    train_y = torch.from_numpy(ty.astype(np.int64))
    test_x = torch.from_numpy(ex.astype(np.float32)) / 255.0
    test_y = torch.from_numpy(ey.astype(np.int64))
    steps_per_epoch = len(tx) // (world * args.batch)
    model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    # MlpModel::Init: one stream over the layers, W[l] row-major (out x in), as torch's.
    rng = Stream(mix1(args.seed ^ 0x6A09E667F3BCC908))
    with torch.no_grad():
        for l, lin in enumerate([model[0], model[2], model[4]]):
            bound = np.sqrt(6.0 / layers[l])
            u = (rng.next(layers[l] * layers[l + 1]) >> np.uint64(11)).astype(np.float64)
            u *= 1.0 / 9007199254740992.0
            w = ((2.0 * u - 1.0) * bound).astype(np.float32).reshape(layers[l + 1], layers[l])
            lin.weight.copy_(torch.from_numpy(w))
            lin.bias.zero_()
elif args.model == "cnn":
    # As examples/pytorch/fashion_mnist_cnn.py builds, initialises and feeds it.
    tx = idx("train-images-idx3-ubyte.gz", 16)
    train_x = torch.tensor(tx, dtype=torch.float32).view(-1, 1, 28, 28) / 255
    train_y = torch.tensor(idx("train-labels-idx1-ubyte.gz", 8), dtype=torch.long)
    if args.max_train:
        train_x, train_y = train_x[:args.max_train], train_y[:args.max_train]
    test_x = torch.tensor(idx("t10k-images-idx3-ubyte.gz", 16), dtype=torch.float32).view(-1, 1, 28, 28) / 255
    test_y = torch.tensor(idx("t10k-labels-idx1-ubyte.gz", 8), dtype=torch.long)
    if args.max_test:
        test_x, test_y = test_x[:args.max_test], test_y[:args.max_test]
    steps_per_epoch = len(train_x) // (world * args.batch)

    Net = example_net()
    torch.manual_seed(0)
    model = Net()
    cnn_gen = torch.Generator().manual_seed(1)
elif args.model == "gpt":
    # As examples/pytorch/gpt.py builds, initialises and feeds it, with its defaults.
    gpt = example_gpt(["--size", args.gpt_size, "--steps", str(args.steps), "--batch",
                       str(args.batch), "--lr", repr(args.lr), "--eval_every",
                       str(args.eval_every or args.steps)])
    gpt["rank"], gpt["world"] = rank, world
    gpt_args = gpt["args"]
    # gpt.py's epoch: training bytes read per step over the training bytes.
    steps_per_epoch = len(gpt["train"]) / (world * args.batch * gpt["context"])
    torch.manual_seed(gpt_args.seed)
    model = gpt["GPT"]()
    clip_params = list(model.parameters())
    # The causal masks: bool buffers, constant and equal on every rank, which
    # gloo cannot broadcast (DDP's construction broadcasts every buffer).
    DDP._set_params_and_buffers_to_ignore_for_model(
        model, [n for n, b in model.named_buffers() if b.dtype == torch.bool])
else:
    steps_per_epoch = 0
    rows = args.dim // args.matrices
    side = int(np.sqrt(rows))
    while rows % side:
        side -= 1
    shape = (side, rows // side)

    class Synthetic(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(args.seed)
            self.w = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.rand(shape, generator=g) * 2 - 1)
                 for _ in range(args.matrices)])
            gc = torch.Generator().manual_seed(1000 + rank)
            for i in range(args.matrices):
                self.register_buffer(f"c{i}", torch.randn(shape, generator=gc) * 0.1)

        def forward(self):
            return sum((w * getattr(self, f"c{i}")).sum() for i, w in enumerate(self.w))

    model = Synthetic()

dist.init_process_group("gloo", rank=rank, world_size=world)
bucket_mb = 25  # DDP's default
if args.hook == "powersgd":
    # One bucket: torch 1.13's PowerSGD hook issues a bucket's second allreduce
    # (Q) from a future's callback, so with several buckets the ranks can issue
    # gloo collectives in different orders (seen here: "op.preamble.length <=
    # op.nbytes" aborts, and hangs). The first bucket's cap is DDP's knob for it.
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    dist._DEFAULT_FIRST_BUCKET_BYTES = whole + 1
    bucket_mb = whole / 2**20 + 1
ddp = DDP(model, broadcast_buffers=False, bucket_cap_mb=bucket_mb)  # rank 0's weights become everyone's
if args.hook == "fp16":
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
elif args.hook == "powersgd":
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    state = powerSGD_hook.PowerSGDState(process_group=None,
                                        matrix_approximation_rank=args.powersgd_rank,
                                        start_powerSGD_iter=max(2, args.powersgd_start))
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
if args.model == "gpt":
    # gpt.py --local's optimizer and schedule: its param groups, warm-up + cosine.
    opt = torch.optim.AdamW(gpt["param_groups"](model), lr=args.lr, betas=(0.9, 0.999), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, gpt["lr_factor"])
else:
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps) if args.cosine else None


def phase(step):
    """warmup: plain fp32 allreduce; compress: the hook compresses (fp16 from step 0)."""
    if args.hook == "fp16" or (args.hook == "powersgd" and step >= max(2, args.powersgd_start)):
        return "compress"
    return "warmup"


def evaluate():
    if args.model == "gpt":  # the validation loss per byte and next-byte accuracy
        return gpt["evaluate"](model)
    model.eval()
    with torch.no_grad():
        out = torch.cat([model(x) for x in test_x.split(1000)])
    model.train()
    acc = (out.argmax(1) == test_y).double().mean().item()
    return F.cross_entropy(out, test_y).item(), acc


if args.bench:
    # The examples' --bench (examples/pytorch/front_bench.py) with DDP in the
    # front's place: a copy of the model without DDP times forward + backward
    # alone, then DDP's steps (its allreduce in the backward, AdamW's step) on
    # the same batches; gpt clips in both, as gpt.py does.
    if args.model not in ("cnn", "gpt"):
        sys.exit("ddp_worker: --bench takes --model cnn or gpt")
    import copy
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "examples", "pytorch"))
    import front_bench
    twin = copy.deepcopy(model)

    def bench_backward(m, b):
        loss = gpt["loss_of"](m, b) if args.model == "gpt" else F.cross_entropy(m(b[0]), b[1])
        loss.backward()
        if args.model == "gpt" and gpt_args.clip:
            torch.nn.utils.clip_grad_norm_(list(m.parameters()), gpt_args.clip)
        return loss

    def bench_batches():
        perm = torch.randperm(len(train_x), generator=cnn_gen) if args.model == "cnn" else None
        for step in itertools.count():
            if args.model == "gpt":
                yield {}, gpt["batch"]()
            else:
                first = ((step % steps_per_epoch) * world + rank) * args.batch
                ids = perm[first:first + args.batch]
                yield {}, (train_x[ids], train_y[ids])

    dist.barrier()
    front_bench.run(f"ddp-{args.model}", rank, opt, ddp, twin, bench_backward, bench_batches(),
                    args.bench, True, True)
    dist.barrier()
    sys.stderr.flush()
    os._exit(0)

rank_csv = open(os.path.join(args.out, f"rank{rank}.csv"), "w")
rank_csv.write("step,wall_s,tx_bytes,rx_bytes,fwd_bwd_s,opt_s\n")
metrics = None
if rank == 0:
    metrics = open(os.path.join(args.out, "metrics.csv"), "w")
    metrics.write("step,phase,loss,wall_s,bytes_up,bytes_down,step_s,push_s,reply_s,epoch,"
                  "test_loss,test_accuracy\n")
dist.barrier()
t0 = time.perf_counter()
last = t0
tx0, rx0 = nic_bytes()
accuracy = test_loss = None
loss = torch.zeros(())
for step in range(args.steps):
    tc = time.perf_counter()
    opt.zero_grad(set_to_none=False)
    if args.model == "mlp":
        epoch = step // steps_per_epoch
        if step % steps_per_epoch == 0:
            perm = torch.from_numpy(epoch_permutation(len(train_y), args.seed, epoch))
        first = (step % steps_per_epoch) * world * args.batch + rank * args.batch
        ids = perm[first:first + args.batch]
        x = train_x[ids].to(torch.float32) / 255.0
        loss = F.cross_entropy(ddp(x), train_y[ids])
    elif args.model == "cnn":
        if step % steps_per_epoch == 0:
            perm = torch.randperm(len(train_x), generator=cnn_gen)
        first = ((step % steps_per_epoch) * world + rank) * args.batch
        ids = perm[first:first + args.batch]
        loss = F.cross_entropy(ddp(train_x[ids]), train_y[ids])
    elif args.model == "gpt":
        loss = gpt["loss_of"](ddp, gpt["batch"]())
    else:
        loss = ddp()
    loss.backward()  # DDP's hooks allreduce the buckets during the backward
    if args.model == "gpt" and gpt_args.clip:
        # gpt.py's clip, here of the averaged gradient (onebit-ps: each worker's own).
        torch.nn.utils.clip_grad_norm_(clip_params, gpt_args.clip)
    to = time.perf_counter()
    opt.step()
    if sched is not None:
        sched.step()
    end = time.perf_counter()
    tx, rx = nic_bytes()
    rank_csv.write(f"{step},{end - t0:.6f},{tx - tx0},{rx - rx0},{to - tc:.6f},{end - to:.6f}\n")
    if metrics is not None:
        ev = ""
        if args.model != "synthetic" and args.eval_every and (
                (step + 1) % args.eval_every == 0 or step + 1 == args.steps):
            test_loss, accuracy = evaluate()
            ev = f"{test_loss:.6g},{accuracy:.6g}"
        else:
            ev = ","
        ep = f"{(step + 1) / steps_per_epoch:.6g}" if steps_per_epoch else "0"
        metrics.write(f"{step},{phase(step)},{loss.item():.6g},{end - t0:.6f},"
                      f"{(tx - tx0) * world},{(rx - rx0) * world},{end - last:.6f},0,0,{ep},{ev}\n")
    tx0, rx0 = tx, rx
    last = end
wall = time.perf_counter() - t0
rank_csv.close()
if metrics is not None:
    metrics.close()
    n_params = sum(p.numel() for p in model.parameters())
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"system": f"ddp-gloo-{args.hook}", "optimizer": "torch.optim.AdamW",
                   "workers": world, "servers": 0, "params": n_params, "steps": args.steps,
                   "wall_s": wall, "final_loss": loss.item(), "test_accuracy": accuracy,
                   "test_loss": test_loss, "status": "ok"}, f, indent=2)
dist.barrier()
score = ""
if args.model == "gpt" and test_loss is not None:
    score = f", validation loss {test_loss:.4f}, next-byte accuracy {accuracy:.4f}"
elif accuracy is not None:
    score = f", test accuracy {accuracy:.4f}"
print(f"ddp rank {rank}: {args.steps} steps in {wall:.1f} s{score}", file=sys.stderr)
sys.stderr.flush()
# Every file is written: skip the interpreter's and gloo's teardown (seconds on a busy machine).
os._exit(0)
