"""examples/pytorch/gpt.py at its tiniest size on a real cluster (onebit-launch:
coordinator, server and 2 workers as processes on 127.0.0.1) against the same
script on one process with torch.optim.AdamW."""
import json
import os
import re
import subprocess
import sys

import pytest

from local_servers import free_local_port

BIN = os.environ["ONEBIT_BIN_DIR"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPT = os.path.join(ROOT, "examples", "pytorch", "gpt.py")
CORPUS = "/usr/share/games/fortunes"
# 8 steps, validation every 2, on 32 windows; per worker 4 sequences of 32 bytes.
ARGS = "--size tiny --steps 8 --eval_every 2 --eval_windows 32 --lr 5e-3"



@pytest.fixture(autouse=True)
def corpus():
    # tools/setup installs it with the Python parts: its absence is a broken
    # set-up, not a reason to skip.
    assert os.path.isdir(CORPUS), f"{CORPUS} is missing: run tools/setup (Debian package fortunes)"


def curve(stderr, prefix=""):
    """Step 0's (untrained) and each evaluation's validation loss, by step."""
    out = {0: float(re.search(prefix + r"gpt: .*step 0 val_loss ([0-9.]+)", stderr).group(1))}
    for t, v in re.findall(prefix + r"gpt: step (\d+) loss [0-9.]+ val_loss ([0-9.]+)", stderr):
        out[int(t)] = float(v)
    return out


def local(split):
    r = subprocess.run([sys.executable, GPT, "--local", "--batch", "8", "--split", str(split)]
                       + ARGS.split(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return curve(r.stderr)


def job(tmp_path, flags):
    out = tmp_path / "run"
    cmd = [os.path.join(BIN, "onebit-launch"), "--workers=2", "--servers=1", f"--out={out}",
           "--launch_register_timeout=30s", "--lr=5e-3",
           f"--worker_cmd=/usr/bin/python3 {GPT} --batch 4 {ARGS}"] + flags
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return curve(r.stderr, r"\[worker0\] "), json.loads((out / "summary.json").read_text())


def test_onebit_ps_adam_trains_the_gpt_as_torch_adamw(tmp_path):
    # Bias correction on: torch's AdamW corrects m and v. Each worker clips
    # its own half of the batch; --split 2 clips the same halves locally.
    ref = local(split=2)
    got, summary = job(tmp_path, ["--optimizer=adam", "--bias_correction"])
    assert sorted(got) == [0, 2, 4, 6, 8]
    for t in got:
        assert got[t] == pytest.approx(ref[t], rel=1e-5, abs=0), (t, got, ref)
    # It learned: every evaluation below the one before, well below untrained.
    values = [got[t] for t in sorted(got)]
    assert all(b < a for a, b in zip(values, values[1:])), values
    assert values[-1] < values[0] - 0.3, values
    assert summary["replicas_equal"] is True and summary["steps"] == 8
    assert summary["test_loss"] == pytest.approx(got[8], abs=2e-6)
    # Clipping was live: clipping the whole batch instead gives other losses.
    whole = local(split=1)
    assert abs(whole[8] - ref[8]) > 1e-4, (whole, ref)


def test_onebit_adam_is_adamw_until_the_freeze_then_compresses(tmp_path):
    ref = local(split=2)
    got, summary = job(tmp_path, ["--optimizer=onebit-adam", "--bias_correction",
                                  "--freeze_step=4"])
    assert summary["freeze_step"] == 4 and summary["compress_steps"] == 4
    # Steps 0-3 are Adam in fp32: the evaluations after 2 and 4 steps match.
    for t in (0, 2, 4):
        assert got[t] == pytest.approx(ref[t], rel=1e-5, abs=0), (t, got, ref)
    # Then 1-bit momenta: another trajectory, still learning.
    assert abs(got[8] - ref[8]) > 1e-4, (got, ref)
    assert got[8] < got[0] - 0.3, got
    assert summary["bytes_up_compress"] < summary["bytes_up_warmup"] / 10


def test_ddp_bench_times_its_steps_against_forward_and_backward_alone(tmp_path):
    """tools/bench/pytorch_front's DDP reference: ddp_worker.py --bench, 2 ranks
    over gloo on 127.0.0.1, each timing blocks of 20 (forward + backward of
    a copy without DDP, then DDP steps on the same batches); the first
    block is not counted, so 45 steps make 2 blocks."""
    worker = os.path.join(ROOT, "tools", "netbench.d", "ddp_worker.py")
    port = str(free_local_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, worker, "--model", "gpt", "--gpt_size", "tiny", "--steps", "45",
             "--bench", "45", "--batch", "4", "--out", str(tmp_path / "ddp")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:  # a rank that failed leaves the other waiting in gloo
            p.kill()
    for rank, (p, err) in enumerate(zip(procs, errs)):
        assert p.returncode == 0, err
        m = re.search(rf"ddp-gpt bench: rank {rank} overlap on phase local blocks (\d+) "
                      r"fwd_bwd_ms ([0-9.]+) step_ms ([0-9.]+) ratio ([0-9.]+)", err)
        assert m, err
        blocks, fwd_bwd, step, ratio = int(m[1]), float(m[2]), float(m[3]), float(m[4])
        assert blocks == 2
        assert fwd_bwd > 0 and step > 0
        assert abs(ratio - step / fwd_bwd) < 0.01 * ratio
