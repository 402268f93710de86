"""DDP's side of tools/project's calibration: torch's AdamW step per element
and gloo's ring allreduce CPU per byte, fp32 and fp16, measured in 2 ranks on
loopback (one thread each, a core each); and what a DDP step costs a rank
beyond its allreduce (the synthetic model's forward and backward, DDP's
bucket copies and, with the fp16 hook, its conversions), printed as five
numbers: AdamW ns per element, ns per byte sent or received of an fp32 and
of an fp16 allreduce, and the step's other CPU in ns per element without
and with the fp16 hook (see step_rest_s).

    /usr/bin/python3 tools/project.d/ddp_costs.py D
"""
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPS = 5


def median_cpu_s(f):
    """The median CPU time (this process's) of REPS calls of f."""
    times = []
    for _ in range(REPS):
        t0 = time.process_time()
        f()
        times.append(time.process_time() - t0)
    return sorted(times)[len(times) // 2]


def adamw_step_s(d):
    """The median of REPS steps of torch's AdamW over d elements held as
    tools/netbench's DDP ranks hold the synthetic model (matrices of about
    1 Mi elements, no weight decay), in a process that has run allreduces
    before, as those ranks have: a fresh process's first steps map their
    temporaries anew and took 2-3x as long."""
    layer = 1 << 20
    params = []
    for i in range(0, d, layer):
        p = torch.nn.Parameter(torch.zeros(min(layer, d - i)))
        p.grad = torch.ones_like(p)
        params.append(p)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    opt.step()
    return median_cpu_s(opt.step)


def step_rest_s(d):
    """What a DDP rank's step costs beyond its allreduce and AdamW, fp32 and
    with the fp16 hook: the forward and backward of a model shaped as
    tools/netbench's synthetic one (24 matrices, loss sum(w * c)), DDP's
    copy of the gradient into its bucket and back after the allreduce with
    the division by the world size, and the hook's conversion to half
    precision with its division (torch 1.13 divides halves element by
    element on the CPU) and back. Each the median of REPS, timed in parts:
    a DDP-wrapped step timed whole here spent more than twice what
    tools/netbench's ranks spend without the hook (docs/sizing.md)."""
    rows = d // 24
    w = [torch.nn.Parameter(torch.rand(rows) * 2 - 1) for _ in range(24)]
    c = [torch.randn(rows) * 0.1 for _ in range(24)]

    def forward_backward():
        for p in w:
            p.grad = None
        sum((p * ci).sum() for p, ci in zip(w, c)).backward()

    g = torch.ones(d)
    bucket = torch.empty(d)
    half = g.to(torch.float16)
    model = median_cpu_s(forward_backward) / (24 * rows)
    copies = median_cpu_s(lambda: (bucket.copy_(g), bucket.div_(2), g.copy_(bucket))) / d
    hook = median_cpu_s(lambda: (g.to(torch.float16).div_(2), g.copy_(half))) / d
    return model + copies, model + copies + hook


def rank(r, port, d, q):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=r, world_size=2)
    out = []
    for dtype in (torch.float32, torch.float16):
        t = torch.ones(d, dtype=dtype)
        dist.all_reduce(t)
        c0 = time.process_time()
        for _ in range(REPS):
            dist.all_reduce(t)
        out.append((time.process_time() - c0) / REPS / (2 * t.element_size() * d))
        del t
    dist.barrier()
    out.append(adamw_step_s(d) / d)
    out.extend(step_rest_s(d))
    q.put(out)
    dist.destroy_process_group()


def main():
    d = int(sys.argv[1])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    procs = [ctx.Process(target=rank, args=(r, port, d, q)) for r in range(2)]
    for x in procs:
        x.start()
    cpu = [q.get(timeout=300) for _ in procs]
    for x in procs:
        x.join()
    # Per byte a rank sends or receives (each rank of a 2-rank ring sends
    # and receives the vector once): fp32, then fp16 (gloo sums halves on
    # the CPU, slowly); AdamW per element, the mean of the two ranks.
    fp32 = sum(c[0] for c in cpu) / 2
    fp16 = sum(c[1] for c in cpu) / 2
    adamw = sum(c[2] for c in cpu) / 2
    step32 = sum(c[3] for c in cpu) / 2
    step16 = sum(c[4] for c in cpu) / 2
    print(adamw * 1e9, fp32 * 1e9, fp16 * 1e9, step32 * 1e9, step16 * 1e9)


if __name__ == "__main__":
    main()
