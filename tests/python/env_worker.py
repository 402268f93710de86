"""Prints the math libraries' thread settings its environment gives it,
then joins the job and leaves it after no step."""
import os
import sys

import torch

import onebit_ps

print("env_worker: " + " ".join(f"{k}={os.environ.get(k)}" for k in
                                 ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")),
      file=sys.stderr)
opt = onebit_ps.DistributedOptimizer(torch.nn.Linear(2, 1), lr=0.01)
onebit_ps.finish()
