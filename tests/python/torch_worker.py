"""A PyTorch training script as a user writes it, with the three onebit_ps
lines; run by the tests through onebit-launch --worker_cmd.

    torch_worker.py STEPS [--nan_at STEP]   (--nan_at: rank 1 makes one
                                            gradient NaN at that step)
"""
import sys

import torch

import onebit_ps

steps = int(sys.argv[1])
nan_at = int(sys.argv[sys.argv.index("--nan_at") + 1]) if "--nan_at" in sys.argv else -1

onebit_ps.init()
torch.manual_seed(100 + onebit_ps.rank())  # each rank its own start: rank 0's wins
model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
model.register_buffer("frozen", torch.ones(3))  # a buffer: stays local
opt = onebit_ps.DistributedOptimizer(model)

# Views, not copies: every trainable tensor lives in the worker's buffer.
base = opt._x.data_ptr()
for p in model.parameters():
    assert base <= p.data_ptr() < base + 4 * opt._x.numel(), "parameter is not a view"
    assert p.grad.data_ptr() != p.data_ptr()

gen = torch.Generator().manual_seed(onebit_ps.rank())
loss_fn = torch.nn.CrossEntropyLoss()
for t in range(steps):
    x = torch.randn(16, 20, generator=gen)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    opt.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    if t == nan_at and onebit_ps.rank() == 1:
        model[2].bias.grad[1] = float("nan")
    try:
        opt.step(loss=loss)
    except onebit_ps.OnebitError as e:
        print(f"torch_worker: step {t}: {e}", file=sys.stderr)
        sys.exit(3)
print(f"torch_worker: rank {onebit_ps.rank()} final loss {loss.item():.4f}", file=sys.stderr)
onebit_ps.finish()
