"""The front's optimizer constructors (OneBitAdam, ZeroOneAdam, OneBitLamb,
DiLoCo) choose what the job leaves to them, and DiLoCo's inner steps are
torch's AdamW."""
import json
import os
import re
import subprocess

import pytest

from front_jobs import BIN, HERE, launch, learned


def test_the_constructor_chooses_what_the_job_leaves_to_it(tmp_path):
    # onebit-launch names no optimizer: OneBitAdam's arguments decide.
    r, s = launch(tmp_path, 2, 1, [],
                  "12 --ctor 'OneBitAdam(model, lr=0.01, freeze_step=5, betas=(0.8, 0.99))'")
    assert r.returncode == 0, r.stderr
    job = json.loads(re.search(r"\[worker0\] torch_worker: job (.*)", r.stderr).group(1))
    assert job == {"optimizer": "onebit-adam", "lr": pytest.approx(0.01), "beta1":
                   pytest.approx(0.8), "beta2": pytest.approx(0.99), "freeze_step": 5,
                   "freeze": "", "worker_codec": "onebit", "bias_correction": False}
    assert s["optimizer"] == "onebit-adam" and s["worker_codec"] == "onebit"
    assert s["compress_steps"] == 7
    assert s["replicas_equal"] is True


def test_zero_one_adam_from_the_constructor_skips_rounds_and_keeps_replicas_equal(tmp_path):
    # 12 steps: v refreshed at k = 1, 2 (kappa 1: then k = 4 is past the
    # freeze at 3); k = 3 compresses; after it the interval doubles every 2
    # steps up to 4: k = 4, 5, 6, 8 and 12 synchronise, 7, 9, 10, 11 do not.
    r, s = launch(tmp_path, 2, 1, ["--dump_params", "--steps=12"],
                  "12 --ctor 'ZeroOneAdam(model, lr=0.01, var_freeze_step=3, "
                  "var_update_scaler=1, local_step_scaler=2, local_step_clipper=4)'")
    assert r.returncode == 0, r.stderr
    assert s["optimizer"] == "zero-one-adam"
    assert s["rounds"] == 8
    assert s["replicas_equal"] is True and s["workers_agree"] is True
    w0 = (tmp_path / "run" / "replica_w0.f32").read_bytes()
    assert w0 == (tmp_path / "run" / "replica_w1.f32").read_bytes()


def test_onebit_lamb_from_the_constructor_shards_whole_tensors(tmp_path):
    # torch_worker's model: W0 (20 x 32 = 640), b0 (32), W1 (32 x 4 = 128),
    # b1 (4); on 2 servers W0 alone, then the rest.
    r, s = launch(tmp_path, 2, 2, ["--dump_params"],
                  "12 --ctor 'OneBitLamb(model, lr=0.1, freeze_step=4, weight_decay=0.01)'")
    assert r.returncode == 0, r.stderr
    assert s["optimizer"] == "onebit-lamb" and s["server_reply"] == "momentum"
    assert s["compress_steps"] == 8
    assert s["replicas_equal"] is True and s["workers_agree"] is True
    # LAMB's trust ratios (|x| / |update| per tensor) make its steps smaller
    # than Adam's at the same lr: 12 steps take the loss from 1.38 to 1.20.
    assert learned(r.stderr, s, factor=0.9, accuracy=0.4), r.stderr
    run = tmp_path / "run"
    assert len((run / "master_s0.f32").read_bytes()) == 4 * 640
    assert len((run / "master_s1.f32").read_bytes()) == 4 * (32 + 128 + 4)
    assert (run / "replica_w0.f32").read_bytes() == (run / "replica_w1.f32").read_bytes()


def test_a_constructor_setting_that_contradicts_the_job_fails_it_naming_both(tmp_path):
    r, s = launch(tmp_path, 2, 1, ["--optimizer=adam", "--lr=0.01"],
                  "12 --ctor 'DistributedOptimizer(model, lr=0.001)'")
    assert r.returncode != 0
    # Whichever worker registers first is refused with the reason.
    assert re.search(r"\[worker[01]\] torch_worker: the coordinator at 127\.0\.0\.1:\d+ refused the "
                     r"registration: worker [01]: --lr: the job sets 0\.01 and the workers declare "
                     r"0\.001; give it in one place\n", r.stderr), r.stderr
    assert s.get("status", "").startswith("failed")


@pytest.mark.parametrize("groups", ["", "--lr_groups"])
def test_diloco_inner_steps_are_torch_adamw_across_syncs(tmp_path, groups):
    # One worker, fp32 both ways, outer lr 1 without momentum: the master
    # after each of the 7 syncs (every 8 steps, and the last) is the local
    # model, so 50 steps track torch.optim.AdamW (bias-corrected, decoupled
    # weight decay, param groups of their own decay and lr on 2 shards).
    out = tmp_path / "run"
    cmd = [os.path.join(BIN, "onebit-launch"), "--workers=1", "--servers=2",
           "--model=external", "--optimizer=diloco", "--weight_decay=0.01", "--lr=0.001",
           "--steps=50", "--worker_codec=fp32", "--server_codec=fp32", f"--out={out}",
           f"--worker_cmd=/usr/bin/python3 {HERE}/adamw_worker.py 50 1e-5 --diloco {groups}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    assert "largest relative difference" in r.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["optimizer"] == "diloco" and s["rounds"] == 7, s
    assert s["replicas_equal"] is True


@pytest.mark.parametrize("fragments,delay", [(1, 0), (2, 1)])
def test_diloco_from_the_constructor_syncs_every_h_steps_with_equal_replicas(tmp_path, fragments,
                                                                              delay):
    # 2 workers, 24 steps, H = 4: steps 3, 7, ..., 23 synchronise (1-bit
    # both ways), the other 18 are local AdamW steps that send nothing. With
    # 2 fragments (one per server) shard 1 syncs 2 steps earlier, at 1, 5,
    # ..., 21, and both at 23, the last (blocks of 256: the 804 parameters
    # fill both shards, 512 and 292). With sync_delay 1 each sync's replies
    # are received, and merged, a step later (the last step's at once).
    r, s = launch(tmp_path, 2, 2, ["--dump_params", "--steps=24", "--block_size=256"],
                  "24 --ctor 'DiLoCo(model, lr=0.03, H=4, inner=torch.optim.AdamW, outer_lr=0.7, "
                  f"fragments={fragments}, sync_delay={delay})'")
    assert r.returncode == 0, r.stderr
    sending = list(range(3, 24, 4)) if fragments == 1 else list(range(1, 24, 2))
    assert s["optimizer"] == "diloco" and s["rounds"] == len(sending), s
    assert s["worker_codec"] == "onebit" and s["server_codec"] == "onebit"
    assert s["replicas_equal"] is True and s["workers_agree"] is True
    run = tmp_path / "run"
    assert (run / "replica_w0.f32").read_bytes() == (run / "replica_w1.f32").read_bytes()
    lines = (run / "metrics.csv").read_text().splitlines()
    rows = [dict(zip(lines[0].split(","), l.split(","))) for l in lines[1:]]
    assert [int(r["step"]) for r in rows if int(r["bytes_up"]) > 0] == sending, lines
    receiving = [t + delay if t < 23 else t for t in sending]
    assert [int(r["step"]) for r in rows if int(r["bytes_down"]) > 0] == receiving, lines
    assert learned(r.stderr, s), r.stderr


def test_diloco_refuses_another_inner_optimizer_and_two_values_of_h():
    # Refused as the optimizer is made, before it reaches the job.
    import torch
    import onebit_ps
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(onebit_ps.OnebitError, match=r"inner optimizer is AdamW"):
        onebit_ps.DiLoCo(params, inner=torch.optim.SGD)
    with pytest.raises(onebit_ps.OnebitError, match=r"H is sync_every; give one"):
        onebit_ps.DiLoCo(params, H=8, sync_every=16)


def test_a_nan_gradient_in_a_diloco_local_step_fails_the_job_at_that_step(tmp_path):
    # Step 2 is local (H = 4): the NaN is refused there, named as the user
    # knows it, not found at the sync of step 3 as a diverged outer gradient.
    r, s = launch(tmp_path, 2, 1, ["--optimizer=diloco", "--sync_every=4", "--steps=6"],
                  "6 --nan_at 2")
    assert r.returncode != 0
    assert "torch_worker: step 2: the gradient of step 2 is not finite" in r.stderr, r.stderr
    assert "(parameter 2.bias[1])" in r.stderr
    assert "[worker1] torch_worker: step 2: replica unchanged" in r.stderr
    assert s.get("status", "").startswith("failed")
