"""DDP's side of tools/project's calibration: torch's AdamW step per element
(one thread, the fastest of a few) and gloo's ring allreduce CPU per byte, fp32 and fp16 (2 ranks on loopback),
printed as three numbers: ns per element, then ns per byte sent or received
of an fp32 and of an fp16 allreduce.

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
    q.put(out)
    dist.destroy_process_group()


def main():
    d = int(sys.argv[1])
    torch.set_num_threads(1)
    # As tools/netbench's DDP ranks hold the synthetic model: matrices of
    # 1 Mi elements, AdamW without weight decay. The fastest of REPS steps.
    layer = 1 << 20
    params = []
    for i in range(0, d, layer):
        p = torch.nn.Parameter(torch.zeros(min(layer, d - i)))
        p.grad = torch.ones_like(p)
        params.append(p)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    opt.step()
    adamw = float("inf")
    for _ in range(REPS):
        t0 = time.perf_counter()
        opt.step()
        adamw = min(adamw, time.perf_counter() - t0)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    procs = [ctx.Process(target=rank, args=(r, port, d, q)) for r in range(2)]
    for x in procs:
        x.start()
    cpu = [q.get(timeout=120) for _ in procs]
    for x in procs:
        x.join()
    # Per byte a rank sends or receives (each rank of a 2-rank ring sends
    # and receives the vector once): fp32, then fp16 (gloo sums halves on
    # the CPU, slowly).
    fp32 = sum(c[0] for c in cpu) / 2
    fp16 = sum(c[1] for c in cpu) / 2
    print(adamw / d * 1e9, fp32 * 1e9, fp16 * 1e9)


if __name__ == "__main__":
    main()
