"""onebit-ps from PyTorch: 1-bit Adam over parameter servers.

    import onebit_ps
    onebit_ps.init()                                 # the job, from the environment
    opt = onebit_ps.DistributedOptimizer(model)      # joins it; rank 0's weights win
    for x, y in loader:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    onebit_ps.finish()

The optimizer (adam, onebit-adam, ef-sgd, ...), its hyper-parameters and the
freeze come from the job (onebit-launch / onebit-coordinator flags, or their
--config file, DeepSpeed's included) or from the constructor
(DistributedOptimizer(model, optimizer="onebit-adam", lr=1e-3,
freeze_step=1000), or OneBitAdam(model, ...)); a setting given in both places
must have the same value, else the job fails naming both. The
model's trainable parameters become views into the worker's one flat fp32
buffer and their .grad views into its gradient buffer, so step() copies
nothing but the compressed payloads; on a GPU worker (ONEBIT_DEVICE=cuda)
they are GPU tensors and the model must be on that GPU. Parameters with
requires_grad=False and buffers (batch-norm statistics) are not trained by
the job and stay local to each worker; they must start equal on every rank,
which the job checks at registration (naming the first that differs).
"""

import atexit
import contextlib
import json
import math
import os
import re
import struct
import sys
import zlib

import torch
import torch.utils.dlpack

from ._onebit import OnebitError, RolledBack, Stopped, Worker

__all__ = ["init", "DistributedOptimizer", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "DiLoCo", "finish", "OnebitError", "JobStopped",
           "RolledBack", "rank", "world_size"]

RolledBack.__doc__ = (
    "The job rolled back to its last complete checkpoint (a process of it was lost and came "
    "back, or its coordinator was restarted); raised by step(), by loss.backward() (from the "
    "gradient hooks) or by finish(). The step did not happen. The model's parameters now hold "
    "the checkpoint's weights: continue your loop, your data and your scheduler at "
    "opt.steps_done, and the job ends bit for bit where it would have.")


class JobStopped(SystemExit):
    """The job stopped on request (a SIGTERM to one of its processes, e.g. a
    Kubernetes preemption) after a complete checkpoint. Raised by step();
    uncaught, it ends the program with status 0. Running the job again
    resumes it: DistributedOptimizer then starts at steps_done."""

    def __init__(self, message):
        super().__init__(0)
        self.message = message

    def __str__(self):
        return self.message

_settings = {}
_optimizer = None  # this process's DistributedOptimizer, once it joined the job
# The parameter types the front trains; the servers' masters are fp32.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def init(coordinator=None, rank=None, device=None, secret_file=None, insecure=None,
         metrics_port=None, local_rank=None):
    """Records where the job is; DistributedOptimizer joins it.

    Defaults come from the environment onebit-launch --worker_cmd sets
    (ONEBIT_COORDINATOR, ONEBIT_RANK or RANK, ONEBIT_DEVICE, ONEBIT_SECRET_FILE:
    the file of the job secret, ONEBIT_INSECURE=1: none), or torchrun with
    ONEBIT_COORDINATOR given once (its RANK; with ONEBIT_DEVICE=cuda, GPU
    LOCAL_RANK, modulo the GPUs the host has). A job needs a secret unless
    it runs insecure. metrics_port (default $ONEBIT_METRICS_PORT, else -1:
    none; 0: any free port): this worker serves its Prometheus metrics
    there (on $ONEBIT_METRICS_HOST, else all addresses), and keeps them up
    $ONEBIT_METRICS_LINGER (e.g. "8s") after finish().

    A job of K local ranks per worker (--local_ranks K: the processes of a
    host add their gradients and push once): local_rank (default
    $ONEBIT_LOCAL_RANK, which onebit-launch sets) is this process's place
    in its worker, and rank its worker's. Under torchrun, set
    ONEBIT_LOCAL_RANKS=K (= --nproc_per_node) once: then local_rank is
    LOCAL_RANK and rank is RANK // K."""
    coordinator = coordinator or os.environ.get("ONEBIT_COORDINATOR", "")
    if not coordinator:
        raise OnebitError(
            "no coordinator: pass init(coordinator='host:port') or set ONEBIT_COORDINATOR "
            "(onebit-launch --worker_cmd sets it)")
    if rank is None:
        rank = _rank(-1)
    if local_rank is None:
        local_rank = _local_rank()
    if local_rank < 0:
        raise OnebitError(f"local_rank {local_rank}: want >= 0")
    if insecure is None:
        insecure = os.environ.get("ONEBIT_INSECURE", "0") == "1"
    if metrics_port is None:
        text = os.environ.get("ONEBIT_METRICS_PORT", "") or "-1"
        try:
            metrics_port = int(text)
        except ValueError:
            raise OnebitError(f"ONEBIT_METRICS_PORT='{text}' is not a port") from None
    if not -1 <= metrics_port <= 65535:
        raise OnebitError(f"metrics_port {metrics_port}: want -1 (none) or a port in [0, 65535]")
    linger = os.environ.get("ONEBIT_METRICS_LINGER", "") or "0s"
    try:
        linger_s = _seconds(linger)
    except ValueError:
        raise OnebitError(f"ONEBIT_METRICS_LINGER='{linger}' is not a duration such as 8s") \
            from None
    device = device or os.environ.get("ONEBIT_DEVICE", "cpu")
    if device == "cuda" and "LOCAL_RANK" in os.environ and torch.cuda.device_count() > 0:
        # A host with several GPUs (torchrun --nproc_per_node K): each
        # process takes its own, in turn where there are more processes.
        device = f"cuda:{int(os.environ['LOCAL_RANK']) % torch.cuda.device_count()}"
    _settings.update(coordinator=coordinator, rank=rank, device=device, local_rank=local_rank,
                     secret_file=secret_file or os.environ.get("ONEBIT_SECRET_FILE", ""),
                     insecure=bool(insecure), metrics_port=metrics_port,
                     metrics_host=os.environ.get("ONEBIT_METRICS_HOST", ""),
                     metrics_linger_s=linger_s)


def _env_int(name, default):
    """The integer in environment variable `name`, or `default` when unset."""
    text = os.environ.get(name, "")
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise OnebitError(f"{name}='{text}' is not an integer") from None


def _seconds(text):
    """A duration as Go and absl write them ("8s", "1m30s", "250ms", "0") in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    total, number, i = 0.0, "", 0
    if text == "0":
        return 0.0
    while i < len(text):
        if text[i].isdigit() or text[i] == ".":
            number += text[i]
            i += 1
            continue
        unit = text[i:i + 2] if text[i:i + 2] in units else text[i]
        if unit not in units or not number:
            raise ValueError(text)
        total += float(number) * units[unit]
        number, i = "", i + len(unit)
    if number:
        raise ValueError(text)
    return total


def _rank(default):
    """The worker's rank: ONEBIT_RANK; else torchrun's RANK, which counts
    processes, divided by ONEBIT_LOCAL_RANKS; else `default`."""
    if "ONEBIT_RANK" in os.environ:
        return _env_int("ONEBIT_RANK", default)
    text = os.environ.get("RANK", "")
    if not text:
        return default
    try:
        r = int(text)
    except ValueError:
        raise OnebitError(f"RANK='{text}' is not a rank") from None
    return r // local_ranks() if r >= 0 else r


def _local_rank():
    if "ONEBIT_LOCAL_RANK" in os.environ:
        return _env_int("ONEBIT_LOCAL_RANK", 0)
    k = local_ranks()
    if k == 1:
        return 0
    size = _env_int("LOCAL_WORLD_SIZE", k)
    if size != k:
        raise OnebitError(f"ONEBIT_LOCAL_RANKS={k} but LOCAL_WORLD_SIZE={size}: a worker's local "
                          "ranks are the processes of one host")
    return _env_int("LOCAL_RANK", 0)


def rank():
    """This process's worker rank (the job's; its local ranks share it)."""
    return _rank(0)


def local_ranks():
    """K, the processes per worker (--local_ranks; $ONEBIT_LOCAL_RANKS)."""
    k = _env_int("ONEBIT_LOCAL_RANKS", 1)
    if k < 1:
        raise OnebitError(f"ONEBIT_LOCAL_RANKS={k}: want K >= 1")
    return k


def local_rank():
    """This process's place in its worker, in [0, K)."""
    return _local_rank()


def data_rank():
    """The rank whose data this process trains on: rank() * K + local_rank()
    among world_size() * K (the job's own models split their data so)."""
    return rank() * local_ranks() + local_rank()


def world_size():
    return int(os.environ.get("ONEBIT_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


class DistributedOptimizer(torch.optim.Optimizer):
    """The job's optimizer over the parameter servers, as a torch Optimizer.

    `params`: a model or its parameters (or param groups; a group's
    'weight_decay' and 'lr' apply to its parameters). Groups with their own
    lr (layer-wise lr decay in fine-tuning) keep the ratios they were made
    with: the servers hold each group's lr as a multiple of the first
    group's with a non-zero lr (the reference group), and the lr a step
    sends is the reference group's. A scheduler must therefore move every
    group by the same factor (LambdaLR with one lambda, warm-up, cosine to
    0, StepLR); one that changes the ratios is an error naming the group.
    A group without 'lr' takes `lr`, or the job's where all groups agree.
    Parameters may be float32 (then views of the worker's buffer), bfloat16
    or float16: the servers keep fp32 master weights, each push sends the
    gradient converted to fp32 (the wire carries fp32 or the job's codecs,
    as for a float32 model), and after every step the parameter takes the
    new master weights rounded to its dtype. torch's GradScaler steps it
    (scaler.step(opt)) with overlap=False: the ranks agree first whether
    any gradient overflowed; if one did, every rank skips the step (the
    job's step does not advance, nothing reaches the servers, and the
    scaler backs off); else the gradients are unscaled (by the scaler's
    1/scale in float32, or already by scaler.unscale_(opt)) and pushed.
    Pass the model itself where you can: then its buffers and
    frozen parameters, which stay local to each worker, are checked to
    start equal on every rank, and errors name parameters as the model does.
    One DistributedOptimizer per process, made once.

    The job's settings, where you want to choose them here rather than on
    onebit-launch: `lr`, `betas` (beta1, beta2), and any other optimizer or
    compression setting by its flag's name (`optimizer`, `eps`,
    `weight_decay` (the default decoupled decay), `bias_correction`,
    `freeze_step`, `freeze`, `worker_codec`, `error_feedback`, ...; see
    `onebit-launch --help`). They apply where the job left the default; one
    the job also sets, to another value, is an error naming both. Every
    worker must pass the same. `self.job` shows what the job runs.

    A scheduler changing param_groups' lr sends the new lr to the servers
    with the step (every worker must agree). `overlap`: push each
    parameter's gradient as soon as backward() has accumulated it. The
    pushed gradient is final: changing it afterwards (clip_grad_norm_, a
    scaling, a second backward() accumulating into it) is an error naming
    the parameter, never lost silently. To accumulate over several
    backward() passes, run all but a step's last one under
    `with opt.no_sync():`; to change gradients between backward() and
    step(), pass overlap=False. `clip_grad_norm`: clip this worker's
    gradient each step as torch.nn.utils.clip_grad_norm_(params, max) would
    (the norm over this optimizer's parameters, in its order; the last one
    in `last_grad_norm`), with overlap where the step pushes fp32 gradients
    (the warm-up): they go out unscaled during backward() and the servers
    apply the factor; in a 1-bit step the pushes wait for step().

    Every parameter is updated at every step, as the servers hold its
    state: a step in which none has a gradient (.grad None, as after
    zero_grad(set_to_none=True) without a backward) does nothing, as in
    torch (every rank must skip it alike), but one in which only some lack
    a gradient, or a parameter set requires_grad=False after the optimizer
    was made, is an error naming them."""

    # torch's GradScaler.step() then calls step(grad_scaler=scaler) and
    # leaves the unscaling and the overflow check to it.
    _step_supports_amp_scaling = True

    def __init__(self, params, lr=None, overlap=True, betas=None, clip_grad_norm=None,
                 **settings):
        global _optimizer
        if clip_grad_norm is not None and not (math.isfinite(clip_grad_norm) and clip_grad_norm > 0):
            raise OnebitError(f"clip_grad_norm={clip_grad_norm!r}: want a finite norm > 0")
        if _optimizer is not None:
            raise OnebitError(
                f"this process has made a DistributedOptimizer already (rank {_optimizer.rank}): "
                "onebit-ps takes one per process, made once; give it every parameter you train "
                "(several models: DistributedOptimizer(list(a.parameters()) + "
                "list(b.parameters())))")
        if not _settings:
            init()
        names, module = {}, None
        if isinstance(params, torch.nn.Module):
            module = params
            names = {id(p): n for n, p in params.named_parameters()}
            params = params.parameters()
        params = list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        groups = [dict(g, params=list(g["params"])) for g in groups]
        every = [p for g in groups for p in g["params"]]
        for i, p in enumerate(every):
            names.setdefault(id(p), f"parameter {i}")
        local = [(names[id(p)], p) for p in every if not p.requires_grad]
        if module is not None:
            local = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
            local += list(module.named_buffers())
        groups = [dict(g, params=[p for p in g["params"] if p.requires_grad]) for g in groups]
        scales = _lr_scales(groups, lr)
        total = sum(p.numel() for g in groups for p in g["params"])
        if total == 0:
            raise OnebitError("DistributedOptimizer: no parameters that require grad")
        ranges, lr_ranges, ends, offset = [], [], [], 0
        for g, scale in zip(groups, scales):
            for p in g["params"]:
                if p.dtype not in _DTYPES or p.is_sparse:
                    kind = "sparse " if p.is_sparse else ""
                    raise OnebitError(
                        f"{names[id(p)]} is a {kind}{p.dtype} parameter of shape "
                        f"{tuple(p.shape)}: onebit-ps trains dense float32, bfloat16 or "
                        "float16 parameters")
                if "weight_decay" in g:
                    ranges.append((offset, offset + p.numel(), float(g["weight_decay"])))
                if scale != 1.0:
                    lr_ranges.append((offset, offset + p.numel(), scale))
                offset += p.numel()
                ends.append(offset)  # every tensor is a layer of onebit-lamb
        ranges, lr_ranges = _merge(ranges), _merge(lr_ranges)
        if lr is not None:
            settings["lr"] = lr
        if betas is not None:
            settings["beta1"], settings["beta2"] = betas
        self._worker = Worker.connect(_settings["coordinator"], _settings["rank"], total,
                                      _settings["device"], os.environ.get("ONEBIT_ADVERTISE_HOST", ""),
                                      ranges, {k: _text(v) for k, v in settings.items()
                                               if v is not None},
                                      secret_file=_settings["secret_file"],
                                      insecure=_settings["insecure"], layer_ends=ends,
                                      local_state=[(n, _crc(t)) for n, t in local],
                                      metrics_port=_settings["metrics_port"],
                                      metrics_host=_settings["metrics_host"],
                                      metrics_linger_s=_settings["metrics_linger_s"],
                                      lr_scale=lr_ranges,
                                      local_rank=_settings.get("local_rank", -1))
        # Joined: from here on, an exit without finish() fails the job (see
        # _exit_check), and this process cannot join again.
        self._ended = False
        _optimizer = self
        job = self._worker.job
        self.job = job
        for g in groups:
            g.setdefault("lr", job["lr"] if lr is None else lr)
        super().__init__(groups, {"lr": job["lr"]})
        # The servers step group k at the sent lr times scales[k]; the lr
        # sent is the reference group's (the first with a non-zero lr).
        self._scales = scales
        self._ref = next((k for k, g in enumerate(groups) if g["lr"] != 0), 0)
        # Views of the worker's buffers, on the CPU or on its GPU.
        self._x = torch.utils.dlpack.from_dlpack(self._worker.params_dlpack())
        self._g = torch.utils.dlpack.from_dlpack(self._worker.grads_dlpack())
        self._cuda = self._x.is_cuda
        self._slices, self._names, self._grads = [], [], []
        # bfloat16/float16 parameters: index -> the fp32 views of x and of the
        # gradient buffer their values go through (the servers keep fp32
        # masters; the model holds them rounded).
        self._low = {}
        offset = 0
        with torch.no_grad():
            for g in self.param_groups:
                for p in g["params"]:
                    name = names[id(p)]
                    if p.device != self._x.device:
                        self._worker.abort(f"{name} is on {p.device}, the worker on {self._x.device}")
                        raise OnebitError(
                            f"{name} is on {p.device} but this worker's buffers are on "
                            f"{self._x.device} ({self._worker.device}): move the model there "
                            f"first, or start the worker with ONEBIT_DEVICE={p.device.type}")
                    n = p.numel()
                    view = self._x[offset:offset + n].view_as(p)
                    view.copy_(p.data)
                    # Each gradient a tensor of its own over the buffer: views of
                    # one tensor share its version counter, and a change to a
                    # gradient after its push must be seen per parameter.
                    grad = torch.utils.dlpack.from_dlpack(self._g[offset:offset + n]).view_as(p)
                    grad.zero_()
                    if p.dtype == torch.float32:
                        p.data = view
                        p.grad = grad
                    else:
                        # autograd keeps a gradient in its parameter's dtype: the
                        # push copies it into the buffer as fp32.
                        self._low[len(self._slices)] = (view, grad)
                        p.grad = torch.zeros_like(p)
                    self._grads.append(p.grad)
                    self._slices.append((p, offset, n))
                    self._names.append(name)
                    offset += n
        self._sync()
        # This step's pushes: parameter index -> its gradient's version then.
        self._pushed = {}
        self._no_sync = False
        self._hooks = []
        if overlap:
            for i, (p, _, _) in enumerate(self._slices):
                # The AccumulateGrad node's hook runs once p.grad is final for
                # this backward (torch 1.13 has no post-accumulate tensor hook).
                node = p.expand_as(p).grad_fn.next_functions[0][0]
                self._hooks.append(node)  # keep it alive: the hook lives on it
                node.register_hook(self._make_hook(i))
        self._overlap = overlap
        self._clip = clip_grad_norm
        self._clip_mode = None  # this step's: "defer" (pushed, scale follows) or "hold"
        self.last_grad_norm = None  # the norm clip_grad_norm saw at the last step
        self.skipped_steps = 0  # steps a GradScaler skipped (a gradient overflowed)
        self._worker.broadcast_parameters()
        self._refresh()
        self._last_lr = job["lr"]
        self._lr_sent = False
        self.last_stats = None  # the last step()'s figures (step, compressed, bytes, step_s)

    def _sync(self):
        # torch's kernels run on its stream; the worker reads and writes the
        # buffers on its own, so what torch queued must be done first.
        if self._cuda:
            torch.cuda.current_stream(self._x.device).synchronize()

    def _fail(self, message):
        """Ends the job with `message` and raises it: the other workers would
        otherwise wait for this one's pushes until their step timeout."""
        self._worker.abort(message)
        raise OnebitError(message)

    def _send_lr(self):
        """Once per step, before its first push: a scheduler's lr goes to the
        servers with the step (they refuse one set after a push)."""
        if self._lr_sent:
            return
        lr = self.param_groups[self._ref]["lr"]
        for k, (g, scale) in enumerate(zip(self.param_groups, self._scales)):
            want = lr * scale
            # The servers' float32 product: a relative 1e-6 covers its rounding.
            if abs(g["lr"] - want) > 1e-6 * max(abs(want), abs(g["lr"])):
                self._fail(
                    f"param group {k} has lr {g['lr']!r}, but the servers step it at {scale!r} "
                    f"x group {self._ref}'s lr {lr!r} = {want!r}: each group's lr keeps the "
                    "ratio to the others it had when the optimizer was made (the servers hold "
                    "it per range of parameters); a scheduler must move every group by one "
                    "factor")
        if lr != self._last_lr:
            self._worker.set_learning_rate(float(lr))
            self._last_lr = lr
        self._lr_sent = True

    def _adopt(self, i):
        """Puts parameter i's gradient into the worker's buffer when autograd
        or the program replaced the .grad tensor (it was None, or assigned)."""
        p = self._slices[i][0]
        if p.grad is not self._grads[i]:
            self._grads[i].copy_(p.grad)
            p.grad = self._grads[i]
        if i in self._low:
            self._low[i][1].copy_(self._grads[i])  # into the buffer, as fp32

    def _refresh(self):
        """The bfloat16/float16 parameters take the worker's new x, rounded
        (the fp32 ones are views of it)."""
        with torch.no_grad():
            for i, (view, _) in self._low.items():
                self._slices[i][0].data.copy_(view)

    def _push(self, i):
        p, offset, n = self._slices[i]
        if self._clip is not None:
            if self._clip_mode is None:
                # The warm-up's fp32 gradients go out now and the servers
                # scale them when the clip factor follows; where the push is
                # not the gradient itself (1-bit momenta), they wait for it.
                self._clip_mode = "defer" if self._worker.can_defer_gradient_scale() else "hold"
                if self._clip_mode == "defer":
                    self._worker.defer_gradient_scale()
            if self._clip_mode == "hold":
                return
        if i in self._pushed:
            self._fail(
                f"{self._names[i]}: a second backward() accumulated into its gradient after "
                "this step had pushed it to the servers (overlap=True pushes each gradient as "
                "soon as a backward() has computed it); to accumulate over several backward() "
                "passes run all but the step's last under `with opt.no_sync():`, or pass "
                "overlap=False")
        self._adopt(i)
        self._sync()
        self._send_lr()
        try:
            self._worker.gradients_ready(offset, offset + n)
        except RolledBack:
            raise
        except OnebitError as e:  # the worker has failed the job with it
            raise OnebitError(self._name_element(str(e))) from None
        self._pushed[i] = self._grads[i]._version

    def _make_hook(self, i):
        def hook(*_):
            if self._no_sync:
                return
            try:
                self._push(i)
            except RolledBack:
                self._lr_sent = False
                self._pushed = {}
                self._clip_mode = None
                self._refresh()
                raise
            except OnebitError:
                raise  # the job has failed with it already
            except BaseException as e:
                # Anything else raised here ends the program's backward(); the
                # job must not wait for this worker's pushes.
                self._worker.abort(f"{type(e).__name__} in the gradient hook of "
                                   f"{self._names[i]}: {e}")
                raise
        return hook

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation with overlap=True, as DDP's no_sync(): the
        backward() passes inside accumulate into .grad without pushing; the
        step's last backward(), outside, pushes the sums."""
        before, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = before

    @property
    def rank(self):
        return self._worker.rank

    @property
    def steps_done(self):
        """Steps completed: in a job resumed from a checkpoint, its step at
        first (the model holds the checkpoint's weights); continue your loop,
        your data and your scheduler there."""
        return self._worker.steps_done

    def zero_grad(self, set_to_none=False):
        """As torch's. The gradients stay views of the worker's buffer;
        set_to_none=True makes them None until the next backward()."""
        if self._pushed:
            self._fail(f"zero_grad() after backward() had pushed {self._list(self._pushed)} in "
                       "this step: call it before backward(), or step() first")
        if set_to_none:
            for p, _, _ in self._slices:
                p.grad = None
            return
        self._g.zero_()
        for i, (p, _, _) in enumerate(self._slices):
            if p.grad is not self._grads[i]:
                p.grad = self._grads[i]
            if i in self._low:
                self._grads[i].zero_()

    def _list(self, indices):
        names = [self._names[i] for i in sorted(indices)]
        return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")

    def _gather(self):
        """Before a step: checks that every pushed gradient is unchanged, puts
        the others into the buffer; True when no parameter has a gradient."""
        frozen = [i for i, (p, _, _) in enumerate(self._slices) if not p.requires_grad]
        if frozen:
            self._fail(
                f"{self._list(frozen)}: requires_grad is False now, but the optimizer trains "
                "it: the servers would go on moving it with their momentum and weight decay. "
                "onebit-ps trains the parameters it was made with at every step; to freeze "
                "some, make the optimizer (and the job) without them")
        changed, missing = [], []
        for i, (p, _, _) in enumerate(self._slices):
            if i in self._pushed:
                if p.grad is not self._grads[i] or self._grads[i]._version != self._pushed[i]:
                    changed.append(i)
            elif p.grad is None:
                missing.append(i)
            else:
                self._adopt(i)
        if changed:
            self._fail(
                f"the gradient of {self._list(changed)} changed after backward() had pushed it "
                "to the servers (clip_grad_norm_, a scaling, another backward(), or any write "
                "to .grad before step()): the servers have the unchanged one. With overlap=True "
                "the gradient backward() computes is final; to clip, make the optimizer with "
                "clip_grad_norm=MAX (it clips with overlap); pass overlap=False to "
                "DistributedOptimizer to change gradients before step(), or use opt.no_sync() "
                "to accumulate")
        if missing and len(missing) == len(self._slices):
            return True
        if missing:
            self._fail(
                f"{self._list(missing)} got no gradient in this step (.grad is None, e.g. after "
                "zero_grad(set_to_none=True) when backward() did not reach it): torch would "
                "leave it alone, but onebit-ps updates every parameter at every step; use "
                "zero_grad(set_to_none=False) to train it with a zero gradient, or make the "
                "optimizer without it")
        return False

    @torch.no_grad()
    def step(self, closure=None, loss=None, epoch=None, grad_scaler=None):
        """One step over the servers. `loss` and `epoch` (fractional epochs
        done after it), when given, go to the job's metrics.csv.
        `grad_scaler`: passed by torch's GradScaler.step(opt) (see the class
        docstring); returns None when the step was skipped."""
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            if self._gather():
                return loss  # no gradient at all: torch's step does nothing
            if grad_scaler is not None and self._unscale(grad_scaler):
                self.skipped_steps += 1
                return None
            scale = self._clip_grads() if self._clip is not None else None
            self._send_lr()
            value = float(loss) if loss is not None else None
            self._sync()
            self.last_stats = self._worker.step(value, float(epoch or 0.0), scale)
            self._refresh()
        except Stopped as e:
            self._ended = True
            print(f"onebit_ps: {e}", file=sys.stderr)
            raise JobStopped(str(e)) from None
        except RolledBack:
            self._refresh()
            raise
        except OnebitError as e:
            raise OnebitError(self._name_element(str(e))) from None
        finally:
            self._lr_sent = False
            self._pushed = {}
            self._clip_mode = None
        return loss

    def _clip_grads(self):
        """clip_grad_norm: this worker's gradient norm over all its
        parameters, computed as torch.nn.utils.clip_grad_norm_ does (in the
        optimizer's parameter order), and the factor min(1, max / (norm +
        1e-6)). Returns the factor for the servers when the step's pushes
        went out unscaled (None: the gradient is scaled here, before its
        pushes)."""
        grads = [self._low[i][1] if i in self._low else self._grads[i]
                 for i in range(len(self._slices))]
        total = torch.norm(torch.stack([torch.norm(g.detach(), 2.0) for g in grads]), 2.0)
        self.last_grad_norm = float(total)
        coef = torch.clamp(self._clip / (total + 1e-6), max=1.0)
        if self._clip_mode == "defer":
            return float(coef)
        self._g.mul_(coef.to(self._g.device))
        return None

    def _unscale(self, scaler):
        """GradScaler.step(): agrees with the other ranks whether any
        gradient overflowed and records it for scaler.update(); unscales the
        gradients when none did. True: every rank skips this step."""
        from torch.cuda.amp.grad_scaler import OptState
        if self._pushed:
            self._fail(
                f"GradScaler.step(): backward() had pushed {self._list(self._pushed)} to the "
                "servers still scaled (overlap=True pushes each gradient as backward() computes "
                "it, before the ranks can agree whether one overflowed); make the optimizer "
                "with overlap=False to step through a GradScaler")
        state = scaler._per_optimizer_states[id(self)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        unscaled = state["stage"] is OptState.UNSCALED  # scaler.unscale_(opt) ran
        if unscaled:
            local = any(float(f) != 0 for f in state["found_inf_per_device"].values())
        else:
            local = not bool(torch.isfinite(self._g).all())
        self._sync()
        found = self._worker.agree_on_overflow(local)
        scale = scaler._scale
        state["found_inf_per_device"] = {
            scale.device: torch.full((1,), 1.0 if found else 0.0, device=scale.device)}
        if found:
            self._pushed = {}
            return True
        if not unscaled:
            # As torch's unscale_: 1/scale computed in double, used as a float32.
            inv = scale.double().reciprocal().float().to(self._g.device)
            self._g.mul_(inv)
            for i, (_, low_grad) in self._low.items():
                self._grads[i].copy_(low_grad)  # the model's view of what is pushed
        return False

    def report_evaluation(self, accuracy, loss=float("nan")):
        """Your test-set score after the step just taken, for metrics.csv and
        (rank 0's) summary.json and the plots."""
        self._worker.report_evaluation(float(loss), float(accuracy))

    def _name_element(self, message):
        """Adds which parameter a "chunk [b, e) ... at index i" (or "elements
        [b, e) ...") error means."""
        m = re.search(r"(?:chunk|elements) \[(\d+), \d+\).* at index (\d+)", message)
        if not m:
            return message
        at = int(m.group(1)) + int(m.group(2))
        for (p, offset, n), name in zip(self._slices, self._names):
            if offset <= at < offset + n:
                flat = at - offset
                where = []
                for size in reversed(p.shape):
                    where.append(flat % size)
                    flat //= size
                return f"{message} (parameter {name}{list(reversed(where))})"
        return message

    def state_dict(self):
        """The optimizer's state, gathered from the servers, as
        torch.optim.AdamW's state_dict(): per parameter 'step', 'exp_avg'
        (Adam's m; after the freeze the momentum the replicas step with),
        'exp_avg_sq' (v; frozen after the freeze; diloco: this worker's inner
        AdamW m and v), and param_groups with
        lr, betas, eps and weight_decay; so that
        torch.optim.AdamW(params).load_state_dict(opt.state_dict())
        continues with plain torch (equal to the job's next step where the
        job runs adam with bias_correction). onebit-ps's own state is under
        'onebit': the optimizer, step, frozen, and every array of the
        servers ('server': x, m, v, den, e) and of this worker ('worker':
        mbar, e, ...) as flat tensors over all parameters. Call it between
        steps; any rank may, alone. The job's --checkpoint_dir stays the way
        to resume a onebit-ps job."""
        try:
            s = self._worker.optimizer_state()
        except OnebitError as e:
            raise OnebitError(f"state_dict(): {e}") from None

        def flat(arrays):
            return {k: torch.frombuffer(bytearray(b), dtype=torch.float32) for k, b in arrays.items()}
        server, worker = flat(s["server"]), flat(s["worker"])
        zeros = torch.zeros(self._x.numel())
        m = worker["mbar"] if s["frozen"] and "mbar" in worker else server.get("m", zeros)
        # diloco's workers keep an AdamW state of their own (m and v).
        v = worker["v"] if s["frozen"] and "v" in worker else server.get("v", zeros)
        settings = json.loads(self.job["config_json"])
        state, groups, i = {}, [], 0
        for g in self.param_groups:
            ids = []
            for p in g["params"]:
                _, offset, n = self._slices[i]
                state[i] = {"step": torch.tensor(float(s["bias_steps"] + s["step"])),
                            "exp_avg": m[offset:offset + n].view_as(p).clone().to(p.device),
                            "exp_avg_sq": v[offset:offset + n].view_as(p).clone().to(p.device)}
                ids.append(i)
                i += 1
            groups.append({"lr": g["lr"], "betas": (settings["beta1"], settings["beta2"]),
                           "eps": settings["eps"],
                           "weight_decay": g.get("weight_decay", settings["weight_decay"]),
                           "amsgrad": False, "foreach": None, "maximize": False,
                           "capturable": False, "params": ids})
        return {"state": state, "param_groups": groups,
                "onebit": {"optimizer": self.job["optimizer"], "step": s["step"],
                           "bias_steps": s["bias_steps"], "frozen": s["frozen"],
                           "server": server, "worker": worker}}

    def load_state_dict(self, state_dict):
        """Starts the job from an optimizer state in torch.optim.Adam's or
        AdamW's format (a torch checkpoint's, or state_dict() of an earlier
        onebit-ps job): each parameter's exp_avg and exp_avg_sq become the
        servers' Adam m and v, and its step the steps bias correction goes on
        from; the groups' lr (and initial_lr) are taken, as torch does. Call
        it after making the optimizer and before the first step, on every
        rank as a torch script does: rank 0's is sent (as its weights are),
        the others' are checked only. The parameters are the model's: load
        its weights before making the optimizer. For adam, onebit-adam and
        naive-onebit-adam (whose state before the freeze is Adam's on the
        servers); the state's betas, eps and each group's weight_decay must
        be the job's. A state from after a freeze (state_dict()'s
        'onebit'/'frozen') is refused: its error feedback belongs to that
        job, which resumes from its own --checkpoint_dir."""
        try:
            groups, saved = state_dict["param_groups"], state_dict["state"]
        except (TypeError, KeyError) as e:
            raise OnebitError(f"load_state_dict(): not an optimizer state_dict (no {e})") from None
        ours = state_dict.get("onebit")
        if ours is not None and ours.get("frozen"):
            raise OnebitError(
                f"load_state_dict(): the state is from after the freeze of a {ours.get('optimizer')} "
                f"job (step {ours.get('step')}): its error feedback and frozen v belong to that "
                "job; resume it from its --checkpoint_dir")
        if len(groups) != len(self.param_groups):
            raise OnebitError(f"load_state_dict(): the state has {len(groups)} param groups, "
                              f"this optimizer {len(self.param_groups)}")
        settings = json.loads(self.job["config_json"])
        job_betas = (settings["beta1"], settings["beta2"])
        d = self._x.numel()
        m, v = torch.zeros(d), torch.zeros(d)
        steps, i = None, 0
        for k, (g, sg) in enumerate(zip(self.param_groups, groups)):
            if len(sg["params"]) != len(g["params"]):
                raise OnebitError(f"load_state_dict(): param group {k} of the state has "
                                  f"{len(sg['params'])} parameters, this optimizer's "
                                  f"{len(g['params'])}")
            if sg.get("amsgrad"):
                raise OnebitError(f"load_state_dict(): param group {k} uses amsgrad, which "
                                  "onebit-ps's Adam does not")
            betas = tuple(sg.get("betas", job_betas))
            for what, theirs, job_value in (("beta1", betas[0], job_betas[0]),
                                            ("beta2", betas[1], job_betas[1]),
                                            ("eps", sg.get("eps", settings["eps"]), settings["eps"])):
                if theirs != job_value:
                    raise OnebitError(f"load_state_dict(): param group {k} has {what} {theirs}, "
                                      f"the job {job_value}: give the job --{what} {theirs}")
            wd = g.get("weight_decay", settings["weight_decay"])
            if sg.get("weight_decay", wd) != wd:
                raise OnebitError(f"load_state_dict(): param group {k} has weight_decay "
                                  f"{sg['weight_decay']}, this optimizer's group {wd}")
            for pid in sg["params"]:
                p, offset, n = self._slices[i]
                name = self._names[i]
                i += 1
                st = saved.get(pid)
                if st is None or "exp_avg" not in st or "exp_avg_sq" not in st:
                    raise OnebitError(f"load_state_dict(): {name} has no exp_avg and "
                                      "exp_avg_sq in the state (torch makes them at its first step)")
                t = float(st.get("step", 0))
                if t != int(t) or t < 0 or (steps is not None and t != steps):
                    raise OnebitError(f"load_state_dict(): {name} is at step {t}, "
                                      f"{'the others at ' + str(steps) if steps is not None else 'want a count'}: "
                                      "onebit-ps counts one step for all")
                steps = t
                for key, flat in (("exp_avg", m), ("exp_avg_sq", v)):
                    a = st[key]
                    if tuple(a.shape) != tuple(p.shape):
                        raise OnebitError(f"load_state_dict(): {key} of {name} has shape "
                                          f"{tuple(a.shape)}, the parameter {tuple(p.shape)}")
                    flat[offset:offset + n] = a.detach().reshape(-1).to("cpu", torch.float32)
        try:
            self._worker.seed_optimizer_state(int(steps or 0), m.numpy().tobytes(),
                                              v.numpy().tobytes())
        except OnebitError as e:
            raise OnebitError(f"load_state_dict(): {e}") from None
        for g, sg in zip(self.param_groups, groups):
            for key in ("lr", "initial_lr"):
                if key in sg:
                    g[key] = sg[key]

    def finish(self):
        self._worker.finish()
        self._ended = True


class OneBitAdam(DistributedOptimizer):
    """1-bit Adam over the servers (Tang et al., 2021): DistributedOptimizer
    with optimizer="onebit-adam". Hyper-parameters left as None are the
    job's (its defaults: betas (0.9, 0.999), eps 1e-8, no bias correction as
    DeepSpeed's OnebitAdam, the freeze decided when the variance settles)."""

    def __init__(self, params, lr=None, freeze_step=None, betas=None, eps=None,
                 weight_decay=None, bias_correction=None, overlap=True, **settings):
        super().__init__(params, lr=lr, overlap=overlap, betas=betas, optimizer="onebit-adam",
                         freeze_step=freeze_step, eps=eps, weight_decay=weight_decay,
                         bias_correction=bias_correction, **settings)


class ZeroOneAdam(DistributedOptimizer):
    """0/1 Adam over the servers (Lu et al., 2022; DeepSpeed's ZeroOneAdam):
    DistributedOptimizer with optimizer="zero-one-adam". v is refreshed at
    doubling intervals up to var_freeze_step, then workers take local steps
    and synchronise at doubling intervals up to local_step_clipper (see the
    design doc, section 1.6). Hyper-parameters left as None are the job's.
    The job needs a fixed number of steps."""

    def __init__(self, params, lr=None, var_freeze_step=None, var_update_scaler=None,
                 local_step_scaler=None, local_step_clipper=None, betas=None, eps=None,
                 weight_decay=None, overlap=True, **settings):
        super().__init__(params, lr=lr, overlap=overlap, betas=betas, optimizer="zero-one-adam",
                         var_freeze_step=var_freeze_step, var_update_scaler=var_update_scaler,
                         local_step_scaler=local_step_scaler,
                         local_step_clipper=local_step_clipper, eps=eps,
                         weight_decay=weight_decay, **settings)


class OneBitLamb(DistributedOptimizer):
    """1-bit LAMB over the servers (Li et al., 2021; DeepSpeed's OnebitLamb):
    DistributedOptimizer with optimizer="onebit-lamb". LAMB's trust ratio per
    tensor (each parameter is a layer) for freeze_step steps, then the
    ratios and v are frozen and workers send 1-bit momenta; the servers
    adjust each layer's frozen ratio by how far v has moved (the design doc,
    section 1.7). The servers hold whole tensors.
    Hyper-parameters left as None are the job's."""

    def __init__(self, params, lr=None, freeze_step=None, betas=None, eps=None,
                 weight_decay=None, max_coeff=None, min_coeff=None, coeff_beta=None,
                 factor_max=None, factor_min=None, factor_threshold=None, overlap=True,
                 **settings):
        super().__init__(params, lr=lr, overlap=overlap, betas=betas, optimizer="onebit-lamb",
                         freeze_step=freeze_step, eps=eps, weight_decay=weight_decay,
                         max_coeff=max_coeff, min_coeff=min_coeff, coeff_beta=coeff_beta,
                         factor_max=factor_max, factor_min=factor_min,
                         factor_threshold=factor_threshold, **settings)


class DiLoCo(DistributedOptimizer):
    """DiLoCo over the servers (Douillard et al., 2023): DistributedOptimizer
    with optimizer="diloco". Every worker takes sync_every inner AdamW steps
    on its own replica (lr, betas, eps, weight_decay; bias_correction as
    torch's AdamW unless told otherwise); then the servers average the
    workers' outer gradients (1-bit, without error feedback by default) and
    take one Nesterov step with them (outer_lr, outer_momentum; the job's
    default is DiLoCo's 0.7 and 0.9, tuned for H in the hundreds: at H = 8
    to 32 outer_lr=1, outer_momentum=0.7 trained better in the README's
    measurements), and every replica restarts from it (the design doc,
    section 1.8). fragments: F,
    Streaming DiLoCo's fragments (groups of whole server shards, at most the
    job's servers), each synced every H steps at an offset of its own.
    sync_delay: tau, the inner steps a sync overlaps (below H / fragments):
    the worker steps on while the outer step travels, then merges with it,
    x = x_sync + sync_mix (x - x_sync).
    Hyper-parameters left as None are the job's. The job needs a fixed
    number of steps."""

    def __init__(self, params, lr=None, sync_every=None, outer_lr=None, outer_momentum=None,
                 betas=None, eps=None, weight_decay=None, bias_correction=True, overlap=True,
                 inner=None, H=None, fragments=None, sync_delay=None, sync_mix=None,
                 **settings):
        # inner: the inner optimizer, which is AdamW (the workers' rule runs
        # it); H: DiLoCo's name for sync_every.
        if inner is not None and inner is not torch.optim.AdamW and \
                str(inner).lower() != "adamw":
            raise OnebitError(f"DiLoCo(inner={inner!r}): the inner optimizer is AdamW, run by "
                              "the worker (give inner=torch.optim.AdamW, 'adamw' or nothing)")
        if H is not None:
            if sync_every is not None and sync_every != H:
                raise OnebitError(f"DiLoCo(H={H}, sync_every={sync_every}): H is sync_every; "
                                  "give one")
            sync_every = H
        super().__init__(params, lr=lr, overlap=overlap, betas=betas, optimizer="diloco",
                         sync_every=sync_every, outer_lr=outer_lr,
                         outer_momentum=outer_momentum, eps=eps, weight_decay=weight_decay,
                         bias_correction=bias_correction, fragments=fragments,
                         sync_delay=sync_delay, sync_mix=sync_mix, **settings)


def _text(value):
    """A setting's value as the coordinator's flags take it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _merge(ranges):
    out = []
    for b, e, v in ranges:
        if out and out[-1][1] == b and out[-1][2] == v:
            out[-1] = (out[-1][0], e, v)
        else:
            out.append((b, e, v))
    return out


def _lr_scales(groups, lr):
    """Each group's lr over the reference group's (the first non-zero), as
    the servers' float32 multipliers; all 1.0 where every group trains at
    one lr."""
    lrs = [g.get("lr", lr) for g in groups]
    if len({v for v in lrs if v is not None}) <= 1:
        return [1.0] * len(groups)
    if None in lrs:
        k = lrs.index(None)
        raise OnebitError(
            f"param group {k} has no lr while other groups have different ones ("
            + ", ".join(f"group {j}: {v!r}" for j, v in enumerate(lrs) if v is not None)
            + "): give it an lr, or pass lr= to DistributedOptimizer for the groups without one")
    for k, v in enumerate(lrs):
        if not (math.isfinite(v) and v >= 0):
            raise OnebitError(f"param group {k} has lr {v!r}: want a finite lr >= 0")
    ref = next(v for v in lrs if v != 0)
    # float32, as the servers hold them, so the check in _send_lr compares
    # with what they compute.
    return [struct.unpack("f", struct.pack("f", v / ref))[0] for v in lrs]


def finish():
    """Ends this worker's part of the job (checksums to the coordinator)."""
    if _optimizer is None:
        raise OnebitError("finish(): no DistributedOptimizer was made")
    _optimizer.finish()


def _crc(tensor):
    """A tensor's bytes' CRC-32, for comparing local state across ranks."""
    if tensor.is_meta:
        return 0  # no data
    flat = tensor.detach().to("cpu").reshape(-1).contiguous()
    return zlib.crc32(flat.view(torch.uint8).numpy().tobytes()) if flat.numel() else 0


@atexit.register
def _exit_check():
    # A program that ends without finish() (an uncaught exception, sys.exit)
    # fails the job now: its heartbeats alone would keep it looking alive,
    # and the other workers would wait for its pushes.
    if _optimizer is not None and not _optimizer._ended:
        _optimizer._worker.abort(
            f"rank {_optimizer.rank}'s program exited without onebit_ps.finish() "
            "(an uncaught exception? see its log)")
