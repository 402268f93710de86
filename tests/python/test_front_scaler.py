"""torch.cuda.amp.GradScaler and clipping through the front: an overflowed
iteration is skipped by every rank, clipping with overlap is torch's."""
import os
import re
import subprocess

import pytest

from front_jobs import BIN, HERE, launch, summary_of


def scaler_job(out, mode, args="", optimizer=("--optimizer=onebit-adam", "--freeze_step=4")):
    cmd = [os.path.join(BIN, "onebit-launch"), "--workers=3", "--servers=2", "--model=external",
           *optimizer, "--lr=0.01", "--chunk_elems=64",
           "--block_size=32", f"--out={out}", "--launch_register_timeout=30s",
           f"--worker_cmd=/usr/bin/python3 {HERE}/scaler_worker.py 12 {mode} {args}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    return r, summary_of(out)


# diloco with H = 4 and --sync_delay 2: step 3's sync merges at step 5, and
# the overflow of iteration 5 is voted on while that sync still travels.
DILOCO_DELAYED = ("--optimizer=diloco", "--sync_every=4", "--sync_delay=2", "--steps=11",
                  "--bias_correction")


@pytest.mark.parametrize("mode,plain,inf_at,optimizer", [
    ("scaled", "plain", 5, None), ("clip", "plainclip", 2, None),
    ("scaled", "plain", 5, DILOCO_DELAYED)], ids=["scaled", "clip", "diloco_delayed"])
def test_a_grad_scaler_skips_an_overflowed_step_on_every_rank_and_is_otherwise_exact(
        tmp_path, mode, plain, inf_at, optimizer):
    # Rank 1's gradient of one iteration overflows (in the compression phase,
    # or in the warm-up with scaler.unscale_ and clipping before the step, or
    # in a diloco inner step while a sync travels): every rank skips it, the
    # scale backs off alike everywhere, and the job ends bit for bit where one
    # without a scaler that left that iteration out ends (a power-of-two
    # scale unscales exactly).
    dumps, runs = {}, {}
    for m in (mode, plain):
        dumps[m] = tmp_path / m
        dumps[m].mkdir()
        r, s = scaler_job(tmp_path / f"{m}-run", m, f"--inf_at {inf_at} --dump {dumps[m]}",
                          **({"optimizer": optimizer} if optimizer else {}))
        assert r.returncode == 0, r.stderr
        assert s["steps"] == 11 and s["replicas_equal"] is True, s
        if optimizer:  # syncs at steps 3, 7 and the last, 10
            assert s["optimizer"] == "diloco" and s["rounds"] == 3, s
        runs[m] = r.stderr
    for w in range(3):
        got = (dumps[mode] / f"params-{w}.f32").read_bytes()
        assert len(got) == 4 * (10 * 16 + 16 + 16 * 3 + 3)
        assert got == (dumps[plain] / f"params-{w}.f32").read_bytes(), w
    # Every rank: the same scale after each iteration, halved at the skip
    # (and doubled after 3 clean steps), the skipped one not a job step.
    by_rank = {}
    for w, t, done, what, scale in re.findall(
            r"\[worker(\d)\] scaler_worker: rank \d iteration (\d+) steps_done (\d+) (\w+) "
            r"scale ([0-9.]+)", runs[mode]):
        by_rank.setdefault(w, []).append((int(t), int(done), what, float(scale)))
    assert sorted(by_rank) == ["0", "1", "2"]
    assert by_rank["0"] == by_rank["1"] == by_rank["2"]
    log = by_rank["0"]
    assert [t for t, _, what, _ in log if what == "skipped"] == [inf_at]
    assert log[inf_at][1] == inf_at and log[-1][1] == 11
    assert log[inf_at][3] == log[inf_at - 1][3] / 2
    assert log[inf_at + 3][3] == 2 * log[inf_at][3]  # grown after 3 clean steps


def test_clip_grad_norm_clips_with_overlap_exactly_as_torch_clips_without(tmp_path):
    # The optimizer's clip_grad_norm=0.5 with overlap=True against torch's
    # clip_grad_norm_(0.5) with overlap=False: the same norms and, bit for
    # bit, the same replicas. In the warm-up (4 steps) backward() pushes
    # every gradient and the servers scale them when the factor follows; in
    # the compression phase the pushes wait for step().
    dumps, runs = {}, {}
    for m in ("clipopt", "plainclip"):
        dumps[m] = tmp_path / m
        dumps[m].mkdir()
        r, s = scaler_job(tmp_path / f"{m}-run", m,
                          f"--dump {dumps[m]}" + (" --overlap" if m == "clipopt" else ""))
        assert r.returncode == 0, r.stderr
        assert s["steps"] == 12 and s["replicas_equal"] is True, s
        runs[m] = r.stderr
    for w in range(3):
        got = (dumps["clipopt"] / f"params-{w}.f32").read_bytes()
        assert got == (dumps["plainclip"] / f"params-{w}.f32").read_bytes(), w
    ours = re.findall(r"\[worker0\] scaler_worker: rank 0 iteration (\d+) pushed before step (\d+) "
                      r"norm ([0-9.e-]+)", runs["clipopt"])
    torchs = re.findall(r"\[worker0\] scaler_worker: rank 0 iteration (\d+) norm ([0-9.e-]+)",
                        runs["plainclip"])
    assert [(t, n) for t, _, n in ours] == torchs and len(torchs) == 12
    assert [int(p) for _, p, _ in ours] == [4] * 4 + [0] * 8
    assert max(float(n) for _, n in torchs) > 0.5  # some steps were clipped


def test_a_grad_scaler_with_overlap_fails_the_job_naming_overlap_false(tmp_path):
    r, s = scaler_job(tmp_path / "run", "scaled", "--overlap")
    assert r.returncode != 0
    assert ("GradScaler.step(): backward() had pushed 0.weight, 0.bias, 2.weight, 2.bias to the "
            "servers still scaled") in r.stderr
    assert "make the optimizer with overlap=False to step through a GradScaler" in r.stderr
    assert s.get("status", "").startswith("failed")
