"""Prints the math libraries' thread settings its environment gives it,
then joins the job and leaves it after no step; prints the process's
threads and sockets before init and after finish()."""
import os
import sys

import torch

import onebit_ps


def threads_and_sockets():
    sockets = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass  # the listing's own descriptor, closed by now
    return len(os.listdir("/proc/self/task")), sockets


print("env_worker: " + " ".join(f"{k}={os.environ.get(k)}" for k in
                                 ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")),
      file=sys.stderr)
before = threads_and_sockets()
opt = onebit_ps.DistributedOptimizer(torch.nn.Linear(2, 1), lr=0.01)
joined = threads_and_sockets()
onebit_ps.finish()
print(f"env_worker: threads and sockets before init {before}, joined {joined}, after finish "
      f"{threads_and_sockets()}", file=sys.stderr)
