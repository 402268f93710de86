"""How the front treats torch's gradient habits, one case per run, checked
to the bit on a parameter whose gradient is known exactly; run by
test_front_gradients.py through onebit-launch --worker_cmd (2 workers, --optimizer sgd
--lr 1 unless the case says otherwise).

    grad_worker.py CASE

Every case trains model.w (5 floats, from zero) whose gradient is the
constant c of the step (loss = (w * c).sum()); with plain SGD at lr 1 over
identical workers, a step moves w by exactly -c. On success rank 0 prints
"grad_worker: CASE ok"; a check that fails exits 4 with what it saw; an
OnebitError the case expects is printed as "grad_worker: CASE error: ..."
and exits 3.
"""
import sys

import torch

import onebit_ps

case = sys.argv[1]
onebit_ps.init()
rank = onebit_ps.rank()


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(5))
        self.v = torch.nn.Parameter(torch.zeros(3))
        # A buffer: not trained, must start equal on every rank.
        self.register_buffer("scale", torch.full((2,), 1.0 + (rank if case == "buffers" else 0)))

    def loss(self, c):
        return (self.w * c).sum() + self.v.sum()


def check(ok, what):
    if not ok:
        print(f"grad_worker: {case} FAILED: {what}", file=sys.stderr)
        sys.exit(4)


model = Model()
if case == "double":
    model.double()
c = torch.tensor([1.0, -2.0, 3.0, -4.0, 5.0]) * 1e4  # norm about 7.4e4
overlap = not case.endswith("no_overlap")
try:
    opt = onebit_ps.DistributedOptimizer(model, overlap=overlap)
    if case == "second_optimizer":
        onebit_ps.DistributedOptimizer(torch.nn.Linear(2, 2))
    if case in ("clip", "clip_no_overlap"):
        opt.zero_grad()
        model.loss(c).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        want = -(model.w.grad.clone())  # clipped, as torch computed it
        check(float(norm) > 7e4, f"norm {norm}")
        opt.step()
        check(torch.equal(model.w.detach(), want), f"w {model.w.tolist()}, want {want.tolist()}")
    elif case in ("accumulate", "accumulate_no_sync", "accumulate_no_overlap"):
        ones = torch.ones(5)
        opt.zero_grad()
        if case == "accumulate_no_sync":
            with opt.no_sync():
                model.loss(ones).backward()
        else:
            model.loss(ones).backward()
        model.loss(ones).backward()
        opt.step()
        check(torch.equal(model.w.detach(), torch.full((5,), -2.0)), f"w {model.w.tolist()}")
    elif case == "set_to_none":
        # As torch: a step with no gradient at all does nothing, then
        # training goes on (adam: its momentum would move w otherwise).
        opt.zero_grad()
        model.loss(c).backward()
        opt.step()
        before = model.w.detach().clone()
        opt.zero_grad(set_to_none=True)
        check(model.w.grad is None, "grad not None after zero_grad(set_to_none=True)")
        opt.step()
        check(torch.equal(model.w.detach(), before), f"moved by {(model.w - before).tolist()}")
        model.loss(c).backward()  # autograd makes a new .grad: it must be the one pushed
        opt.step()
        check(not torch.equal(model.w.detach(), before), "the step after did not move w")
        check(opt.steps_done == 2, f"steps_done {opt.steps_done}")
    elif case == "set_to_none_partly":
        opt.zero_grad(set_to_none=True)
        (model.w * c).sum().backward()  # v gets no gradient
        opt.step()
    elif case == "replaced_grad":
        # A .grad assigned by the program (set_to_none, then its own tensor).
        opt.zero_grad(set_to_none=True)
        model.w.grad = -c.clone()
        model.v.grad = torch.zeros(3)
        opt.step()
        check(torch.equal(model.w.detach(), c), f"w {model.w.tolist()}")
    elif case == "nan_loss":
        # A loss reported as NaN by rank 1 fails the step (no loss given is
        # fine: rank 0's second step reports none).
        opt.zero_grad()
        loss = model.loss(c)
        loss.backward()
        opt.step(loss=float("nan") if rank == 1 else loss)
    elif case == "frozen":
        opt.zero_grad()
        model.loss(c).backward()
        opt.step()
        model.v.requires_grad_(False)
        opt.zero_grad()
        model.loss(c).backward()
        opt.step()
    else:
        sys.exit(f"grad_worker: no case {case}")
except onebit_ps.OnebitError as e:
    print(f"grad_worker: {case} error: {e}", file=sys.stderr)
    sys.exit(3)
if rank == 0:
    print(f"grad_worker: {case} ok", file=sys.stderr)
onebit_ps.finish()
