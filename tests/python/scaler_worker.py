"""A worker stepping through a loss scaler: torch's GradScaler (torch 1.13)
with the pieces that are CUDA-only there done on the CPU (scale(),
unscale_(), update()'s rule), since Debian's torch has no CUDA. What
onebit-ps relies on stays torch's own: step() hands the step to an
optimizer with _step_supports_amp_scaling, its per-optimizer state, and
update() reading the found_inf the optimizer recorded.

    scaler_worker.py STEPS MODE [--inf_at T] [--dump DIR] [--overlap]
MODE: plain (no scaler), scaled, clip (scaler.unscale_, then
clip_grad_norm_ 0.5), plainclip (torch's clip_grad_norm_ 0.5 without a
scaler), clipopt (the optimizer's clip_grad_norm=0.5, no scaler; prints how
many gradients backward() had pushed before each step). --inf_at T: rank
1's gradient of iteration T is inf (with plain: iteration T is left out,
as a scaler skips it). Prints the scale after every iteration; writes the
parameters to DIR/params-<rank>.f32."""
import argparse
import os
import sys

import torch
from torch.cuda.amp.grad_scaler import OptState

import onebit_ps

p = argparse.ArgumentParser()
p.add_argument("steps", type=int)
p.add_argument("mode", choices=["plain", "scaled", "clip", "plainclip", "clipopt"])
p.add_argument("--inf_at", type=int, default=-1)
p.add_argument("--dump")
p.add_argument("--overlap", action="store_true")
args = p.parse_args()


class CpuGradScaler(torch.cuda.amp.GradScaler):
    def __init__(self, init_scale, growth_interval):
        super().__init__(init_scale=init_scale, growth_interval=growth_interval)
        # Disabled without CUDA: set what the enabled constructor sets.
        self._enabled = True
        self._init_scale, self._growth_factor, self._backoff_factor = init_scale, 2.0, 0.5
        self._growth_interval, self._init_growth_tracker = growth_interval, 0
        self._scale = torch.full((1,), float(init_scale))
        self._growth_tracker = torch.zeros(1, dtype=torch.int32)
        from collections import defaultdict
        from torch.cuda.amp.grad_scaler import _refresh_per_optimizer_state
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def scale(self, outputs):
        return outputs * self._scale

    def unscale_(self, optimizer):
        state = self._per_optimizer_states[id(optimizer)]
        inv = self._scale.double().reciprocal().float()
        found = torch.zeros(1)
        for g in optimizer.param_groups:
            for q in g["params"]:
                if not bool(torch.isfinite(q.grad).all()):
                    found.fill_(1.0)
                q.grad.mul_(inv)
        state["found_inf_per_device"] = {found.device: found}
        state["stage"] = OptState.UNSCALED

    def update(self):
        # torch's _amp_update_scale_ rule.
        found = sum(float(f) for s in self._per_optimizer_states.values()
                    for f in s["found_inf_per_device"].values())
        if found:
            self._scale *= self._backoff_factor
            self._growth_tracker.zero_()
        else:
            self._growth_tracker += 1
            if int(self._growth_tracker) == self._growth_interval:
                self._scale *= self._growth_factor
                self._growth_tracker.zero_()
        from collections import defaultdict
        from torch.cuda.amp.grad_scaler import _refresh_per_optimizer_state
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


torch.manual_seed(7)
model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
loss_fn = torch.nn.CrossEntropyLoss()
onebit_ps.init()
rank = onebit_ps.rank()
opt = onebit_ps.DistributedOptimizer(model, lr=0.01, overlap=args.overlap,
                                     clip_grad_norm=0.5 if args.mode == "clipopt" else None)
scaler = CpuGradScaler(2.0 ** 10, 3) if args.mode in ("scaled", "clip") else None
for t in range(args.steps):
    if args.mode.startswith("plain") and t == args.inf_at:
        continue  # what the scaler's skip leaves out
    g = torch.Generator().manual_seed(1000 * t + rank)
    x = torch.randn(32, 10, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    opt.zero_grad()
    loss = loss_fn(model(x), y)
    if scaler is None:
        loss.backward()
        if args.mode == "plainclip":
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        pushed = len(opt._pushed)
        opt.step(loss=loss)
        if args.mode == "clipopt":
            print(f"scaler_worker: rank {rank} iteration {t} pushed before step {pushed} "
                  f"norm {opt.last_grad_norm!r}", file=sys.stderr)
        elif args.mode == "plainclip":
            print(f"scaler_worker: rank {rank} iteration {t} norm {float(norm)!r}", file=sys.stderr)
        continue
    if t == args.inf_at and rank == 1:
        model[2].bias.register_hook(lambda grad: torch.full_like(grad, float("inf")))
    try:
        scaler.scale(loss).backward()
    except onebit_ps.OnebitError as e:
        print(f"scaler_worker: step {t}: {e}", file=sys.stderr)
        sys.exit(3)
    if t == args.inf_at and rank == 1:
        model[2].bias._backward_hooks.clear()
    if args.mode == "clip":
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    before = opt.steps_done
    try:
        taken = scaler.step(opt, loss=loss)
    except onebit_ps.OnebitError as e:
        print(f"scaler_worker: step {t}: {e}", file=sys.stderr)
        sys.exit(3)
    scaler.update()
    print(f"scaler_worker: rank {rank} iteration {t} steps_done {opt.steps_done} "
          f"{'skipped' if opt.steps_done == before else 'stepped'} scale {float(scaler._scale)}",
          file=sys.stderr)
if args.dump:
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    flat.numpy().tofile(os.path.join(args.dump, f"params-{rank}.f32"))
print(f"scaler_worker: rank {rank} done, steps_done {opt.steps_done}, skipped "
      f"{opt.skipped_steps}", file=sys.stderr)
onebit_ps.finish()
