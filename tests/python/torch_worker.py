"""A PyTorch training script as a user writes it, with the three onebit_ps
lines; run by the tests through onebit-launch --worker_cmd.

    torch_worker.py STEPS [--nan_at STEP] [--no_overlap]
      --nan_at: rank 1 makes one gradient NaN at that step (after backward)
      --no_overlap: push at step() only, not from the backward hooks
      --schedule: a torch LambdaLR scheduler, lr / (1 + t)
      --wider_rank R: rank R's model has a wider hidden layer
      --ctor EXPR: the optimizer is onebit_ps.EXPR (e.g. "OneBitAdam(model,
        lr=0.01)"); rank 0 prints the job's optimizer settings as JSON
      --model_device D: the model is moved to D first (e.g. meta: not the
        worker's device)
      --stop_server_at STEP: rank 0 stops server 0 (SIGSTOP: silent, as a dead
        host is) before that step, and reports how long the step took to fail
      --sigterm_at STEP: rank 1 sends itself SIGTERM (a preemption) before
        that step; the job stops after a checkpoint
      --kill_server_at STEP: rank 0 kills server 0 (SIGKILL) before that
        step, once; started again by onebit-launch --max_restarts, the job
        rolls back (onebit_ps.RolledBack) to its last checkpoint
      --raise_in_hook STEP: rank 1's own tensor hook raises
        ZeroDivisionError in that step's backward (uncaught: the program dies)
      --group_lrs_at STEP: two param groups (the layers); at that step they
        get different learning rates (0.001 and 0.002)
      --bf16: the model and its inputs in bfloat16 (fp32 masters on the
        servers); after every step each parameter must equal the worker's
        x rounded to bfloat16
A job resumed from a checkpoint, or rolled back to one, continues at
opt.steps_done, the data where it was. At the end every rank prints what
opt.state_dict() gathered (CRC-32s of exp_avg and exp_avg_sq). Writes the
final parameters to $ONEBIT_DUMP_X when set.
"""
import json
import os
import signal
import sys
import time
import zlib

import torch

import onebit_ps
from local_servers import signal_server

steps = int(sys.argv[1])
nan_at = int(sys.argv[sys.argv.index("--nan_at") + 1]) if "--nan_at" in sys.argv else -1

onebit_ps.init()
torch.manual_seed(100 + onebit_ps.data_rank())  # each its own start: rank 0's wins
wider = int(sys.argv[sys.argv.index("--wider_rank") + 1]) if "--wider_rank" in sys.argv else -1
hidden = 33 if onebit_ps.rank() == wider else 32
model = torch.nn.Sequential(torch.nn.Linear(20, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4))
model.register_buffer("frozen", torch.ones(3))  # a buffer: stays local
if "--model_device" in sys.argv:
    model.to(sys.argv[sys.argv.index("--model_device") + 1])
dtype = torch.bfloat16 if "--bf16" in sys.argv else torch.float32
model.to(dtype)
shapes = [tuple(p.shape) for p in model.parameters()]
keys = list(model.state_dict().keys())
try:
    if "--ctor" in sys.argv:
        opt = eval("onebit_ps." + sys.argv[sys.argv.index("--ctor") + 1])
        if onebit_ps.rank() == 0:
            job = json.loads(opt.job["config_json"])
            shown = ("optimizer", "lr", "beta1", "beta2", "freeze_step", "freeze", "worker_codec",
                     "bias_correction")
            print("torch_worker: job " + json.dumps({k: job[k] for k in shown}), file=sys.stderr)
    elif "--group_lrs_at" in sys.argv:
        opt = onebit_ps.DistributedOptimizer([{"params": model[0].parameters()},
                                              {"params": model[2].parameters()}])
    else:
        opt = onebit_ps.DistributedOptimizer(model, overlap="--no_overlap" not in sys.argv)
except onebit_ps.OnebitError as e:
    print(f"torch_worker: {e}", file=sys.stderr)
    sys.exit(3)

# The shapes are the model's own, in the model's order.
assert [tuple(p.shape) for p in model.parameters()] == shapes, "shapes changed"
assert list(model.state_dict().keys()) == keys
# Views, not copies: every float32 trainable tensor lives in the worker's
# buffer; a bfloat16 one holds the worker's x rounded.
base = opt._x.data_ptr()


def check_params():
    offset = 0
    for p in model.parameters():
        assert p.dtype == dtype and p.grad.dtype == dtype
        if dtype == torch.float32:
            assert base <= p.data_ptr() < base + 4 * opt._x.numel(), "parameter is not a view"
        else:
            x = opt._x[offset:offset + p.numel()].view_as(p)
            assert torch.equal(p.data, x.to(dtype)), "parameter is not the rounded master"
        assert p.grad.data_ptr() != p.data_ptr()
        offset += p.numel()


check_params()

sched = (torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
         if "--schedule" in sys.argv else None)
loss_fn = torch.nn.CrossEntropyLoss()
eval_x = torch.randn(256, 20, generator=torch.Generator().manual_seed(99))
eval_y = (eval_x[:, 0] > 0).long() + 2 * (eval_x[:, 1] > 0).long()
eval_x = eval_x.to(dtype)
stop_at = int(sys.argv[sys.argv.index("--stop_server_at") + 1]) if "--stop_server_at" in sys.argv else -1


def batch(t):
    # Each step's data from its number alone, so a resumed or rolled-back
    # job sees what it would have.
    gen = torch.Generator().manual_seed(1000 * onebit_ps.data_rank() + t)
    x = torch.randn(16, 20, generator=gen)
    return x.to(dtype), (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()


def signal_server_0(sig):
    signal_server(0, sig)


sigterm_at = int(sys.argv[sys.argv.index("--sigterm_at") + 1]) if "--sigterm_at" in sys.argv else -1
kill_at = int(sys.argv[sys.argv.index("--kill_server_at") + 1]) if "--kill_server_at" in sys.argv else -1
raise_at = int(sys.argv[sys.argv.index("--raise_in_hook") + 1]) if "--raise_in_hook" in sys.argv else -1
group_lrs_at = (int(sys.argv[sys.argv.index("--group_lrs_at") + 1])
                if "--group_lrs_at" in sys.argv else -1)
start = opt.steps_done
if onebit_ps.rank() == 0:
    # The job's initial weights (rank 0's, or a resumed checkpoint's): what
    # training must improve on.
    with torch.no_grad():
        print(f"torch_worker: step {start} untrained eval loss "
              f"{loss_fn(model(eval_x), eval_y).item()!r}", file=sys.stderr)
if start:
    print(f"torch_worker: rank {onebit_ps.rank()} resumes at step {start}", file=sys.stderr)
t_stop = None
t = start
while t < steps:
    if t == sigterm_at and onebit_ps.rank() == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    if t == stop_at and onebit_ps.rank() == 0:
        signal_server_0(signal.SIGSTOP)
        t_stop = time.monotonic()
    if t == kill_at and onebit_ps.rank() == 0:
        signal_server_0(signal.SIGKILL)
        kill_at = -1
    if t == group_lrs_at:
        opt.param_groups[0]["lr"], opt.param_groups[1]["lr"] = 0.001, 0.002
    x, y = batch(t)
    opt.zero_grad()
    loss = loss_fn(model(x), y)
    if t == nan_at and onebit_ps.rank() == 1:
        # Poison the last layer's bias gradient inside backward, as a
        # numerical accident would.
        model[2].bias.register_hook(lambda g: g.index_fill(0, torch.tensor([1]), float("nan")))
    if t == raise_at and onebit_ps.rank() == 1:
        model[0].weight.register_hook(lambda g: 1 / 0)
    before = opt._x.clone()
    try:
        loss.backward()
    except onebit_ps.RolledBack as e:
        print(f"torch_worker: step {t}: {e}", file=sys.stderr)
        t = opt.steps_done
        continue
    except onebit_ps.OnebitError as e:
        print(f"torch_worker: step {t}: {e}", file=sys.stderr)
        if torch.equal(opt._x, before):
            print(f"torch_worker: step {t}: replica unchanged", file=sys.stderr)
        sys.exit(3)
    try:
        opt.step(loss=loss, epoch=(t + 1) / 4)  # 4 steps an "epoch"
        check_params()
        if sched is not None:
            sched.step()
    except onebit_ps.RolledBack as e:
        print(f"torch_worker: step {t}: {e}", file=sys.stderr)
        t = opt.steps_done
        continue
    except onebit_ps.OnebitError as e:
        after = f" (failed {time.monotonic() - t_stop:.1f} s after the stop)" if t_stop else ""
        print(f"torch_worker: step {t}: {e}{after}", file=sys.stderr)
        if torch.equal(opt._x, before):
            print(f"torch_worker: step {t}: replica unchanged", file=sys.stderr)
        sys.exit(3)
    if (t + 1) % 4 == 0 and onebit_ps.rank() == 0:
        with torch.no_grad():
            out = model(eval_x)
            acc = (out.argmax(1) == eval_y).float().mean().item()
            opt.report_evaluation(acc, loss=loss_fn(out, eval_y).item())
        print(f"torch_worker: step {t} eval {acc!r} loss {loss_fn(out, eval_y).item()!r}",
              file=sys.stderr)
    t += 1
# Still views after training: state_dict() shares the worker's memory.
for name, tensor in model.state_dict().items():
    if name != "frozen" and dtype == torch.float32:
        assert base <= tensor.data_ptr() < base + 4 * opt._x.numel(), name
check_params()
def _crc(t):
    return zlib.crc32(t.numpy().tobytes())


if onebit_ps.local_rank() > 0:  # its worker's local rank 0 holds the state
    print(f"torch_worker: rank {onebit_ps.rank()}.{onebit_ps.local_rank()} final loss "
          f"{loss.item():.4f}", file=sys.stderr)
    if os.environ.get("ONEBIT_DUMP_X"):
        opt._x.numpy().tofile(os.environ["ONEBIT_DUMP_X"])
    onebit_ps.finish()
    sys.exit(0)
# The optimizer's state, gathered from the servers: the torch view of it is
# the onebit view's m (after the freeze the replica's momentum) and v.
sd = opt.state_dict()
ob = sd["onebit"]
flat = lambda key: torch.cat([sd["state"][i][key].flatten() for i in sorted(sd["state"])])
m_of = ob["worker"]["mbar"] if ob["frozen"] and "mbar" in ob["worker"] else ob["server"]["m"]
v_of = ob["worker"]["v"] if ob["frozen"] and "v" in ob["worker"] else ob["server"]["v"]
assert torch.equal(flat("exp_avg"), m_of) and torch.equal(flat("exp_avg_sq"), v_of)
if json.loads(opt.job["config_json"])["server_reply"] != "delta":  # replicas equal the master
    assert torch.equal(ob["server"]["x"], opt._x)
print(f"torch_worker: rank {onebit_ps.rank()} state step {ob['step']} frozen {ob['frozen']} "
      f"server {sorted(ob['server'])} worker {sorted(ob['worker'])} "
      f"crc {_crc(flat('exp_avg'))} {_crc(flat('exp_avg_sq'))}", file=sys.stderr)
# After training the state is refused (seeding is for before the first step).
try:
    opt.load_state_dict(sd)
    sys.exit("torch_worker: load_state_dict() after training should be refused")
except onebit_ps.OnebitError as e:
    assert ("after the freeze" if ob["frozen"] else "only before the job's first step") in str(e), e
print(f"torch_worker: rank {onebit_ps.rank()} final loss {loss.item():.4f}", file=sys.stderr)
if os.environ.get("ONEBIT_DUMP_X"):
    opt._x.numpy().tofile(os.environ["ONEBIT_DUMP_X"])
onebit_ps.finish()
