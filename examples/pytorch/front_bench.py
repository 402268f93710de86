"""The --bench mode of the examples (tools/bench/pytorch_front): the steps of
the front against forward + backward alone, on the same batches, in the same
process. Not needed to use onebit-ps."""
import statistics
import sys
import time


def run(name, rank, opt, model, twin, backward, batches, total_steps, local, overlap, block=20):
    """Blocks of `block` batches: backward(twin, batch) on each (forward,
    backward and whatever the script does before step(), with no onebit-ps),
    then the steps on the same batches: opt.zero_grad(), backward(model,
    batch), opt.step(**kwargs). `batches` yields (step kwargs, batch). Per
    block: wall and CPU time (this process, all its threads) per iteration;
    the first step of a block, which waits for the slowest rank's twin
    block, is not counted. Prints each phase's means over its blocks."""
    blocks, it, t = {}, iter(batches), 0
    clocks = lambda: (time.perf_counter(), time.process_time())
    while t < total_steps:
        chunk = [next(it) for _ in range(min(block, total_steps - t))]
        t += len(chunk)
        w0, c0 = clocks()
        for _, b in chunk:
            twin.zero_grad()
            backward(twin, b)
        w1, c1 = clocks()
        twin_wall, twin_cpu = (w1 - w0) / len(chunk), (c1 - c0) / len(chunk)
        phases, in_step = set(), 0.0
        for n, (kwargs, b) in enumerate(chunk):
            if n == 1:
                w0, c0 = clocks()
            opt.zero_grad()
            loss = backward(model, b)
            w1 = time.perf_counter()
            opt.step() if local else opt.step(loss=loss, **kwargs)
            in_step += (time.perf_counter() - w1) if n else 0.0
            phases.add("local" if local else "compress" if opt.last_stats["compressed"] else "warmup")
        w1, c1 = clocks()
        if t > len(chunk) and len(phases) == 1 and len(chunk) > 1:  # not the first block; one phase
            k = len(chunk) - 1
            blocks.setdefault(phases.pop(), []).append(
                (twin_wall, twin_cpu, (w1 - w0) / k, (c1 - c0) / k, in_step / k))
    for phase, b in blocks.items():
        fb, fb_cpu, st, st_cpu, call = (statistics.mean(v[i] for v in b) * 1e3 for i in range(5))
        print(f"{name} bench: rank {rank} overlap {'on' if overlap else 'off'} "
              f"phase {phase} blocks {len(b)} fwd_bwd_ms {fb:.2f} step_ms {st:.2f} ratio {st / fb:.3f} "
              f"in_step_call_ms {call:.2f} fwd_bwd_cpu_ms {fb_cpu:.2f} step_cpu_ms {st_cpu:.2f}",
              file=sys.stderr, flush=True)
