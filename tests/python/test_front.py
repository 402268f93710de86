"""The PyTorch front on real clusters: onebit-launch --worker_cmd runs
torch_worker.py as every worker (coordinator, servers and workers are real
processes on 127.0.0.1)."""
import json
import os
import re
import subprocess
import sys
import time

import pytest

BIN = os.environ["ONEBIT_BIN_DIR"]
HERE = os.path.dirname(os.path.abspath(__file__))


def learned(stderr, summary, factor=0.75, accuracy=0.5):
    """Whether the job learned: rank 0's last evaluation and the final
    training loss well below the untrained loss of the job's initial weights
    (about 1.38 = ln 4, chance for 4 classes, so a bound like 1.5 would hold
    for a model that never moved)."""
    untrained = float(re.search(r"\[worker0\] torch_worker: step 0 untrained eval loss ([0-9.]+)",
                                stderr).group(1))
    acc, loss = re.findall(r"\[worker0\] torch_worker: step \d+ eval ([0-9.]+) loss ([0-9.]+)",
                           stderr)[-1]
    return (float(loss) < factor * untrained and float(acc) >= accuracy
            and summary["final_loss"] < factor * untrained)


def launch(tmp_path, workers, servers, flags, args):
    out = tmp_path / "run"
    cmd = [os.path.join(BIN, "onebit-launch"), f"--workers={workers}", f"--servers={servers}",
           "--model=external", f"--out={out}", "--launch_register_timeout=30s",
           f"--worker_cmd=/usr/bin/python3 {HERE}/torch_worker.py {args}"] + flags
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    return r, summary


@pytest.mark.parametrize("optimizer", ["adam", "onebit-adam"])
def test_four_by_two_cluster_of_torch_workers_ends_with_equal_replicas(tmp_path, optimizer):
    r, s = launch(tmp_path, 4, 2, [f"--optimizer={optimizer}", "--freeze_step=5", "--lr=0.01"],
                  "12")
    assert r.returncode == 0, r.stderr
    assert s["replicas_equal"] is True
    assert s["steps"] == 12
    assert s["params"] == 20 * 32 + 32 + 32 * 4 + 4
    assert s["compress_steps"] == (7 if optimizer == "onebit-adam" else 0)
    # A loss was reported every step, and the model learned.
    assert learned(r.stderr, s), r.stderr
    # Rank 0's evaluations every 4 steps reached metrics.csv and the summary.
    evals = re.findall(r"\[worker0\] torch_worker: step (\d+) eval ([0-9.]+)", r.stderr)
    assert [int(t) for t, _ in evals] == [3, 7, 11]
    assert s["test_accuracy"] == pytest.approx(float(evals[-1][1]), abs=1e-6)
    lines = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    by_step = {int(r["step"]): r for r in (dict(zip(lines[0].split(","), l.split(",")))
                                           for l in lines[1:])}
    assert float(by_step[3]["epoch"]) == 1.0 and float(by_step[11]["epoch"]) == 3.0
    assert float(by_step[3]["test_accuracy"]) == pytest.approx(float(evals[0][1]), abs=1e-6)
    assert by_step[4]["test_accuracy"] == ""
    # state_dict() on every rank after the last step: the servers' arrays of
    # the optimizer's phase, and one m and v for all (momentum replies: the
    # replicas' momentum is the servers' averaged one).
    states = re.findall(r"\[worker(\d)\] torch_worker: rank \d state step 12 frozen (\w+) "
                        r"server (\[.*?\]) worker (\[.*?\]) crc (\d+) (\d+)", r.stderr)
    assert sorted(int(w) for w, *_ in states) == [0, 1, 2, 3], r.stderr
    assert len({tuple(rest) for _, *rest in states}) == 1
    _, frozen, server, worker, _, _ = states[0]
    if optimizer == "onebit-adam":
        # The servers let m go at the freeze: the workers carry it on.
        assert (frozen, server, worker) == ("True", "['den', 'e', 'v', 'x']",
                                            "['den', 'e', 'mbar']")
    else:
        assert (frozen, server, worker) == ("False", "['m', 'v', 'x']", "[]")


@pytest.mark.parametrize("optimizer", ["adam", "onebit-adam"])
def test_a_bfloat16_model_trains_on_fp32_masters(tmp_path, optimizer):
    # torch_worker --bf16 checks after every step that each bfloat16
    # parameter is the worker's fp32 x rounded; the replicas (fp32) end equal
    # and the model learns.
    r, s = launch(tmp_path, 2, 2, [f"--optimizer={optimizer}", "--freeze_step=5", "--lr=0.01"],
                  "16 --bf16")
    assert r.returncode == 0, r.stderr
    assert s["replicas_equal"] is True
    assert s["compress_steps"] == (11 if optimizer == "onebit-adam" else 0)
    assert learned(r.stderr, s), r.stderr
    # The wire carried what a float32 model's would: fp32 in the warm-up.
    assert s["params"] == 20 * 32 + 32 + 32 * 4 + 4


def test_auto_freeze_on_four_by_two(tmp_path):
    r, s = launch(tmp_path, 4, 2, ["--optimizer=onebit-adam", "--freeze=auto:0.5:5", "--lr=0.01"],
                  "30")
    assert r.returncode == 0, r.stderr
    assert s["replicas_equal"] is True
    assert 0 < s["compress_steps"] < 30


@pytest.mark.parametrize("overlap", [True, False])
def test_nan_gradient_is_an_exception_and_fails_the_job(tmp_path, overlap):
    r, s = launch(tmp_path, 2, 1, ["--optimizer=adam", "--lr=0.01"],
                  "6 --nan_at 2" + ("" if overlap else " --no_overlap"))
    assert r.returncode != 0
    assert "torch_worker: step 2:" in r.stderr
    assert "non-finite" in r.stderr
    # Named as the user knows it: model[2].bias, element 1.
    assert "(parameter 2.bias[1])" in r.stderr
    # The failed step applied nothing to the replica that saw the NaN.
    assert "[worker1] torch_worker: step 2: replica unchanged" in r.stderr
    assert s.get("status", "").startswith("failed")


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


@pytest.mark.parametrize("groups", ["", "--groups", "--lr_groups", "--groups --state_dict"])
def test_warmup_adam_over_the_servers_tracks_torch_adamw(tmp_path, groups):
    # Adam forever (no freeze), bias correction on, decoupled weight decay 0.01:
    # the same update as torch.optim.AdamW, computed by the servers; with
    # param groups of their own weight decay, and of their own lr under a
    # schedule (on two shards, so the ranges cross a shard boundary).
    out = tmp_path / "run"
    servers = 2 if groups == "--lr_groups" else 1
    cmd = [os.path.join(BIN, "onebit-launch"), "--workers=1", f"--servers={servers}",
           "--model=external", "--optimizer=adam", "--bias_correction", "--weight_decay=0.01",
           "--lr=0.001", f"--out={out}",
           f"--worker_cmd=/usr/bin/python3 {HERE}/adamw_worker.py 100 1e-5 {groups}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    assert "largest relative difference" in r.stderr


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


def test_worker_programs_get_their_share_of_the_cores_unless_the_caller_chose(tmp_path):
    # torch's OpenMP and OpenBLAS would start a thread per core in every
    # worker (OpenBLAS's spin when idle); a value in the environment stays.
    share = max(1, (os.cpu_count() or 1) // 2)
    cmd = [os.path.join(BIN, "onebit-launch"), "--workers=2", "--servers=1", "--model=external",
           "--optimizer=adam", f"--out={tmp_path / 'run'}", "--launch_register_timeout=30s",
           f"--worker_cmd=/usr/bin/python3 {HERE}/env_worker.py"]
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    env["OPENBLAS_NUM_THREADS"] = "3"
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    want = f"OMP_NUM_THREADS={share} OPENBLAS_NUM_THREADS=3 MKL_NUM_THREADS={share}"
    assert r.stderr.count(f"env_worker: {want}") == 2, r.stderr
    assert (f"launch: worker programs get OMP_NUM_THREADS={share} MKL_NUM_THREADS={share} "
            f"({os.cpu_count()} cores for 2 workers") in r.stderr


def seed_job(out, workers, servers, flags, args):
    cmd = [os.path.join(BIN, "onebit-launch"), f"--workers={workers}", f"--servers={servers}",
           "--model=external", "--weight_decay=0.01", "--lr=0.001", f"--out={out}",
           "--launch_register_timeout=30s",
           f"--worker_cmd=/usr/bin/python3 {HERE}/seed_worker.py {args}"] + flags
    if "--optimizer=zero-one-adam" not in flags:  # it has no such setting
        cmd.append("--bias_correction")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    return r, summary


@pytest.mark.parametrize("optimizer", ["adam", "onebit-adam"])
def test_load_state_dict_continues_torch_adamws_training_over_the_servers(tmp_path, optimizer):
    # 30 steps of torch.optim.AdamW, then its model and state_dict() start a
    # job that runs 20 more beside it: bias correction goes on from step 30
    # (without it the first steps would differ by ~2 %).
    r, s = seed_job(tmp_path / "run", 1, 1, [f"--optimizer={optimizer}", "--freeze_step=100"],
                    "0 20 --torch 30 --bound 1e-5")
    assert r.returncode == 0, r.stderr
    assert "30 steps in torch, then 20 over the servers" in r.stderr
    assert s["status"] == "ok" and s["steps"] == 20


def test_a_job_seeded_with_another_jobs_state_dict_continues_it_bitwise(tmp_path):
    # Job "whole" runs steps 0-40 (freeze at 30). Job "first" runs 0-8 and
    # saves the model and opt.state_dict(); job "rest" loads them and runs
    # 8-40 (freeze at 22 of its own steps): with a server killed at its
    # step 13 and the job rolled back to a checkpoint of the warm-up, so the
    # seeded bias_steps must survive the checkpoint too. Bit for bit equal.
    job = ["--optimizer=onebit-adam", "--chunk_elems=64", "--block_size=32"]
    dumps = {k: tmp_path / k for k in ("whole", "rest")}
    for d in dumps.values():
        d.mkdir()
    r, _ = seed_job(tmp_path / "whole-run", 2, 2, job + ["--freeze_step=30"],
                    f"0 40 --dump {dumps['whole']}")
    assert r.returncode == 0, r.stderr
    saved = tmp_path / "first.pt"
    r, _ = seed_job(tmp_path / "first-run", 2, 2, job + ["--freeze_step=30"], f"0 8 --save {saved}")
    assert r.returncode == 0, r.stderr
    ckpt = [f"--checkpoint_dir={tmp_path}/ckpt", "--checkpoint_every=5", "--max_restarts=1"]
    r, s = seed_job(tmp_path / "rest-run", 2, 2, job + ["--freeze_step=22"] + ckpt,
                    f"8 40 --load {saved} --dump {dumps['rest']} --kill_server_at 21")
    assert r.returncode == 0, r.stderr
    assert s["status"] == "ok" and s["rollbacks"] == 1, s
    assert s["resumed_from_step"] in (5, 10), s  # in the warm-up: bias correction still counts
    assert s["compress_steps"] == 10
    for w in range(2):
        got = (dumps["rest"] / f"params-{w}.f32").read_bytes()
        assert len(got) == 4 * (10 * 16 + 16 + 16 * 3 + 3)
        assert got == (dumps["whole"] / f"params-{w}.f32").read_bytes(), w


@pytest.mark.parametrize("optimizer", ["adam", "zero-one-adam"])
def test_load_state_dict_refuses_what_it_cannot_seed_by_name(tmp_path, optimizer):
    # seed_worker.py --errors asserts each message; the job then trains.
    r, s = seed_job(tmp_path / "run", 1, 1, [f"--optimizer={optimizer}", "--steps=2"],
                    "0 2 --errors")
    assert r.returncode == 0, r.stderr
    refused = re.findall(r"seed_worker: refused: (.*)", r.stderr)
    assert len(refused) == (2 if optimizer == "zero-one-adam" else 7), r.stderr
    assert s["status"] == "ok" and s["steps"] == 2


def scaler_job(out, mode, args="", optimizer=("--optimizer=onebit-adam", "--freeze_step=4")):
    cmd = [os.path.join(BIN, "onebit-launch"), "--workers=3", "--servers=2", "--model=external",
           *optimizer, "--lr=0.01", "--chunk_elems=64",
           "--block_size=32", f"--out={out}", "--launch_register_timeout=30s",
           f"--worker_cmd=/usr/bin/python3 {HERE}/scaler_worker.py 12 {mode} {args}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    return r, summary


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


def test_pushing_from_the_backward_hooks_changes_nothing(tmp_path):
    # With a scheduler too: its lr must reach the servers before the hooks'
    # first push of the step.
    runs = {}
    for overlap, sched in [(True, False), (False, False), (True, True), (False, True)]:
        d = tmp_path / f"{overlap}-{sched}"
        d.mkdir()
        r, s = launch(d, 3, 2, ["--optimizer=onebit-adam", "--freeze_step=4", "--lr=0.01",
                                "--block_size=32", "--chunk_elems=64", "--dump_params"],
                      "10" + ("" if overlap else " --no_overlap") + (" --schedule" if sched else ""))
        assert r.returncode == 0, r.stderr
        assert s["replicas_equal"] is True
        runs[overlap, sched] = [(d / "run" / f"replica_w{i}.f32").read_bytes() for i in range(3)]
    assert len(runs[True, False][0]) == 4 * (20 * 32 + 32 + 32 * 4 + 4)
    assert runs[True, False] == runs[False, False]
    assert runs[True, True] == runs[False, True]
    # The schedule reached the servers: another lr, another result.
    assert runs[True, True] != runs[True, False]


def test_workers_on_the_gpu_code_path_train_bitwise_as_on_the_cpu(tmp_path):
    # cuda-twin: the GPU worker's code (device replica, its kernels' CPU
    # twins) behind the same torch views; a real GPU differs in the memory.
    runs = {}
    for devices in ("cpu", "cuda-twin,cpu,cuda-twin"):
        d = tmp_path / devices.replace(",", "_")
        d.mkdir()
        r, s = launch(d, 3, 2, ["--optimizer=onebit-adam", "--freeze_step=4", "--lr=0.01",
                                "--block_size=32", "--chunk_elems=64", "--dump_params",
                                f"--worker_devices={devices}"], "10")
        assert r.returncode == 0, r.stderr
        assert s["replicas_equal"] is True
        assert s["worker_devices"] == (devices.split(",") if "," in devices else ["cpu"] * 3)
        runs[devices] = [(d / "run" / f"replica_w{i}.f32").read_bytes() for i in range(3)]
    assert runs["cpu"] == runs["cuda-twin,cpu,cuda-twin"]


def test_a_model_on_another_device_than_the_worker_is_refused_naming_both(tmp_path):
    r, s = launch(tmp_path, 2, 1, ["--optimizer=adam"], "3 --model_device meta")
    assert r.returncode != 0
    assert ("torch_worker: 0.weight is on meta but this worker's buffers are on cpu (cpu): "
            "move the model there first, or start the worker with ONEBIT_DEVICE=meta") in r.stderr


def test_a_rank_with_another_model_size_is_refused_at_init(tmp_path):
    r, s = launch(tmp_path, 2, 1, ["--optimizer=adam"], "3 --wider_rank 1")
    assert r.returncode != 0
    assert "declares d = " in r.stderr
    assert "d = 804" in r.stderr and "d = 829" in r.stderr


def test_a_dead_server_is_an_exception_within_the_step_timeout(tmp_path):
    # The coordinator would notice only after its 60 s heartbeat timeout: the
    # worker's own wait (twice the 2 s step timeout) must end the step first.
    r, s = launch(tmp_path, 2, 2, ["--optimizer=adam", "--step_timeout=2s",
                                   "--heartbeat_timeout=60s"],
                  "20 --stop_server_at 3")
    assert r.returncode != 0
    m = re.search(r"\[worker0\] torch_worker: step 3: (.*) \(failed ([0-9.]+) s after the stop\)",
                  r.stderr)
    assert m, r.stderr
    assert "server 0" in m.group(1) and "is it dead?" in m.group(1)
    assert "within 4s" in m.group(1)  # the worker's own bound, twice the step timeout
    # Not before that bound; and by the worker's wait, not the coordinator's
    # 60 s heartbeat timeout (the upper bound leaves a loaded machine room).
    assert 3.5 < float(m.group(2)) < 30
    assert s.get("status", "").startswith("failed")


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


# The uninterrupted job that the stopped and the rolled-back ones must end
# as: run once for both.
RESUMED_JOB = ["--optimizer=onebit-adam", "--freeze_step=20", "--lr=0.01", "--dump_params"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    plain, _ = launch(tmp_path / "plain", 3, 2, RESUMED_JOB, "400")
    assert plain.returncode == 0, plain.stderr
    return tmp_path / "plain"


def test_a_sigterm_stops_the_job_after_a_checkpoint_and_it_resumes_bitwise(tmp_path,
                                                                          uninterrupted):
    job = RESUMED_JOB
    ckpt = [f"--checkpoint_dir={tmp_path}/ckpt", "--checkpoint_every=100000"]
    r, s = launch(tmp_path / "run", 3, 2, job + ckpt, "400 --sigterm_at 60")
    assert r.returncode == 0, r.stderr  # every process exited 0
    assert s["status"].startswith("stopped: SIGTERM to worker 1; the checkpoint of step "), s
    at = s["stopped_at_step"]
    assert 60 <= at < 400
    assert f"[worker2] onebit_ps: the job stopped: SIGTERM to worker 1" in r.stderr
    again, s2 = launch(tmp_path / "run", 3, 2, job + ckpt, "400")
    assert again.returncode == 0, again.stderr
    assert f"torch_worker: rank 0 resumes at step {at}" in again.stderr
    assert s2["status"] == "ok" and s2["resumed_from_step"] == at
    for w in range(3):
        got = (tmp_path / "run" / "run" / f"replica_w{w}.f32").read_bytes()
        assert got == (uninterrupted / "run" / f"replica_w{w}.f32").read_bytes(), w


def test_a_killed_server_comes_back_and_the_torch_workers_roll_back_bitwise(tmp_path,
                                                                          uninterrupted):
    job = RESUMED_JOB
    ckpt = [f"--checkpoint_dir={tmp_path}/ckpt", "--checkpoint_every=50", "--max_restarts=1"]
    r, s = launch(tmp_path / "run", 3, 2, job + ckpt, "400 --kill_server_at 180")
    assert r.returncode == 0, r.stderr
    assert "launch: server0 failed (signal 9 (Killed)); restart 1 of 1: starting it again" in r.stderr
    # Every worker's loop caught onebit_ps.RolledBack and went on at opt.steps_done.
    rolled = re.findall(r"\[worker(\d)\] torch_worker: step (\d+): the job rolled back to the "
                        r"checkpoint of step (\d+)", r.stderr)
    assert sorted(w for w, _, _ in rolled) == ["0", "1", "2"], r.stderr
    at = int(rolled[0][2])
    assert at % 50 == 0 and 100 <= at <= 180 and all(int(a) == at for _, _, a in rolled)
    assert s["status"] == "ok" and s["rollbacks"] == 1 and s["resumed_from_step"] == at, s
    for w in range(3):
        got = (tmp_path / "run" / "run" / f"replica_w{w}.f32").read_bytes()
        assert got == (uninterrupted / "run" / f"replica_w{w}.f32").read_bytes(), w
    for k in range(2):
        got = (tmp_path / "run" / "run" / f"master_s{k}.f32").read_bytes()
        assert got == (uninterrupted / "run" / f"master_s{k}.f32").read_bytes(), k


def grad_case(tmp_path, case, steps, flags=("--optimizer=sgd", "--lr=1")):
    out = tmp_path / "run"
    cmd = [os.path.join(BIN, "onebit-launch"), "--workers=2", "--servers=1", "--model=external",
           f"--steps={steps}", f"--out={out}", "--launch_register_timeout=30s", *flags,
           f"--worker_cmd=/usr/bin/python3 {HERE}/grad_worker.py {case}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    return r, summary


@pytest.mark.parametrize("case", ["clip_no_overlap", "accumulate_no_sync", "accumulate_no_overlap",
                                  "replaced_grad"])
def test_torch_gradient_habits_train_exactly(tmp_path, case):
    # grad_worker checks w to the bit: the clipped gradient (not the 7.4e4
    # norm one), both accumulated backward passes (-2, not -1), a .grad the
    # program assigned.
    r, s = grad_case(tmp_path, case, 1)
    assert r.returncode == 0, r.stderr
    assert f"grad_worker: {case} ok" in r.stderr
    assert s["status"] == "ok" and s["replicas_equal"] is True


def test_a_gradient_changed_after_its_overlapped_push_fails_naming_it(tmp_path):
    # clip_grad_norm_ after backward() with overlap=True: the servers have the
    # unclipped gradient, so the step must not go on as if clipped.
    r, s = grad_case(tmp_path, "clip", 1)
    assert r.returncode != 0
    assert re.search(r"\[worker[01]\] grad_worker: clip error: the gradient of w, v changed after "
                     r"backward\(\) had pushed it", r.stderr), r.stderr
    assert "pass overlap=False" in r.stderr
    assert "grad_worker: clip ok" not in r.stderr
    assert s["status"].startswith("failed") and "changed after backward()" in s["status"]


def test_a_second_backward_into_a_pushed_gradient_fails_naming_it(tmp_path):
    r, s = grad_case(tmp_path, "accumulate", 1)
    assert r.returncode != 0
    assert re.search(r"grad_worker: accumulate error: (v|w): a second backward\(\) accumulated "
                     r"into its gradient after this step had pushed it", r.stderr), r.stderr
    assert "with opt.no_sync()" in r.stderr
    assert s["status"].startswith("failed")


def test_a_step_without_any_gradient_does_nothing_as_in_torch(tmp_path):
    r, s = grad_case(tmp_path, "set_to_none", 2, ("--optimizer=adam", "--lr=0.01"))
    assert r.returncode == 0, r.stderr
    assert "grad_worker: set_to_none ok" in r.stderr
    assert s["steps"] == 2 and s["replicas_equal"] is True


@pytest.mark.parametrize("case,message", [
    ("set_to_none_partly", r"v got no gradient in this step \(\.grad is None"),
    ("frozen", r"v: requires_grad is False now, but the optimizer trains it"),
])
def test_a_parameter_left_out_of_a_step_fails_naming_it(tmp_path, case, message):
    r, s = grad_case(tmp_path, case, 2)
    assert r.returncode != 0
    assert re.search(rf"grad_worker: {case} error: {message}", r.stderr), r.stderr
    assert s["status"].startswith("failed")


def test_a_nan_loss_reported_to_step_fails_the_job_naming_rank_and_step(tmp_path):
    r, s = grad_case(tmp_path, "nan_loss", 1)
    assert r.returncode != 0
    assert "grad_worker: nan_loss error: loss is not finite (nan) at rank 1 step 0" in r.stderr, \
        r.stderr
    assert "loss is not finite (nan) at rank 1 step 0" in s["status"]


def test_buffers_that_differ_between_ranks_fail_the_job_naming_them(tmp_path):
    # Buffers are not trained or broadcast: ranks that start them apart would
    # train different models while replicas_equal said true.
    r, s = grad_case(tmp_path, "buffers", 1)
    assert r.returncode != 0
    assert re.search(r"worker [01]'s scale differs from worker [01]'s \(CRC-32 [0-9a-f]{8} against "
                     r"[0-9a-f]{8}\): tensors the job does not train", r.stderr), r.stderr
    assert "grad_worker: buffers ok" not in r.stderr


@pytest.mark.parametrize("case,message", [
    ("second_optimizer", "this process has made a DistributedOptimizer already (rank "),
    ("double", "w is a torch.float64 parameter of shape (5,): onebit-ps trains dense float32, "
               "bfloat16 or float16 parameters"),
])
def test_unsupported_uses_are_refused_naming_what(tmp_path, case, message):
    r, s = grad_case(tmp_path, case, 1)
    assert r.returncode != 0
    assert f"grad_worker: {case} error: {message}" in r.stderr, r.stderr


def test_an_exception_in_a_backward_hook_ends_the_job_failed_at_once(tmp_path):
    # Rank 1's own tensor hook raises inside backward(); its program dies of
    # it. The job must fail at once (not after the 60 s heartbeat timeout,
    # nor hang in the interpreter's exit), naming why.
    start = time.monotonic()
    r, s = launch(tmp_path, 2, 1, ["--optimizer=adam", "--heartbeat_timeout=60s",
                                   "--step_timeout=60s"], "6 --raise_in_hook 2")
    took = time.monotonic() - start
    assert r.returncode != 0
    assert "[worker1] ZeroDivisionError" in r.stderr, r.stderr
    assert "launch: stopping worker1" not in r.stderr  # it exited by itself
    assert ("rank 1's program exited without onebit_ps.finish() (an uncaught exception? see its "
            "log)") in s["status"], s
    assert took < 30, took


def test_an_error_in_the_fronts_own_hook_fails_the_job_at_once(tmp_path):
    # A scheduler that changes the ratio of the groups' learning rates (made
    # equal, then 0.001 and 0.002): the servers hold the ratio, so the front
    # refuses in its hook, at the first push of the step.
    start = time.monotonic()
    r, s = launch(tmp_path, 2, 1, ["--optimizer=adam", "--heartbeat_timeout=60s",
                                   "--step_timeout=60s"], "6 --group_lrs_at 2")
    assert r.returncode != 0
    assert re.search(r"\[worker[01]\] torch_worker: step 2: param group 1 has lr 0\.002, but the "
                     r"servers step it at 1\.0 x group 0's lr 0\.001 = 0\.001", r.stderr), r.stderr
    assert "aborted by its program: param group 1 has lr 0.002" in s["status"]
    assert time.monotonic() - start < 30


def test_workers_with_torchruns_environment_join_a_coordinator_given_once(tmp_path):
    """Without onebit-launch: a coordinator and a server started by hand, and
    two workers with the environment torchrun gives its processes (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); ONEBIT_COORDINATOR is
    the one thing the user adds. (Debian 12's torchrun itself, torch 1.13 on
    Python 3.11, fails before it starts a process, so the test sets what it
    would.)"""
    port_file = tmp_path / "port"
    out = tmp_path / "run"
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("coordinator", "server")}
    coordinator = subprocess.Popen(
        [os.path.join(BIN, "onebit-coordinator"), "--workers=2", "--servers=1",
         "--model=external", "--optimizer=onebit-adam", "--freeze_step=5", "--insecure",
         "--bind_host=127.0.0.1", "--port=0", f"--port_file={port_file}", f"--out={out}",
         "--register_timeout=60s"],
        stdout=logs["coordinator"], stderr=subprocess.STDOUT)
    procs = []
    try:
        deadline = time.time() + 30
        while not port_file.exists() and time.time() < deadline:
            assert coordinator.poll() is None, (tmp_path / "coordinator.log").read_text()
            time.sleep(0.05)
        target = f"127.0.0.1:{port_file.read_text().strip()}"
        procs.append(subprocess.Popen(
            [os.path.join(BIN, "onebit-server"), f"--coordinator={target}", "--shard=0",
             "--insecure", "--bind_host=127.0.0.1", "--advertise_host=127.0.0.1",
             "--data_port=0", "--health_port=0"],
            stdout=logs["server"], stderr=subprocess.STDOUT))
        base = {k: v for k, v in os.environ.items() if not k.startswith("ONEBIT_")}
        base.update(ONEBIT_COORDINATOR=target, ONEBIT_INSECURE="1", WORLD_SIZE="2",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
                    PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(BIN, "python"),
                                                             os.environ.get("PYTHONPATH")])))
        workers = [subprocess.Popen(
            ["/usr/bin/python3", os.path.join(HERE, "torch_worker.py"), "30"],
            env=dict(base, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True) for r in range(2)]
        procs += workers
        for w in workers:
            output = w.communicate(timeout=240)[0]
            assert w.returncode == 0, output[-3000:]
        assert coordinator.wait(timeout=60) == 0, (tmp_path / "coordinator.log").read_text()
        assert procs[0].wait(timeout=60) == 0, (tmp_path / "server.log").read_text()
    finally:
        for p in procs + [coordinator]:
            if p.poll() is None:
                p.kill()
                p.wait()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok"
    assert summary["workers"] == 2 and summary["steps"] == 30
    assert summary["replicas_equal"] and summary["workers_agree"]
    assert summary["freeze_step"] == 5
    log = (tmp_path / "coordinator.log").read_text()
    assert "worker 0 registered" in log and "worker 1 registered" in log, log


def test_workers_serve_their_metrics_on_the_port_the_launcher_gives_them(tmp_path):
    """onebit-launch --metrics_port P: worker R's front reads
    ONEBIT_METRICS_PORT (P+1+S+R) in init() and serves its own metrics there,
    up to its last step (and --metrics_linger after it)."""
    import urllib.request
    from local_servers import free_local_ports
    first = free_local_ports(5)
    out = tmp_path / "run"
    cmd = [os.path.join(BIN, "onebit-launch"), "--workers=2", "--servers=2", "--model=external",
           f"--out={out}", "--launch_register_timeout=30s", "--optimizer=onebit-adam",
           "--freeze_step=5", f"--metrics_port={first}", "--metrics_linger=4s",
           f"--worker_cmd=/usr/bin/python3 {HERE}/torch_worker.py 12"]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = {}
    deadline = time.time() + 240
    while job.poll() is None and time.time() < deadline:
        for rank in range(2):
            try:
                url = f"http://127.0.0.1:{first + 3 + rank}/metrics"
                with urllib.request.urlopen(url, timeout=1) as r:
                    seen[rank] = r.read().decode()
            except OSError:
                pass
        time.sleep(0.1)
    log = job.communicate(timeout=60)[0]
    assert job.returncode == 0, log
    summary = json.loads((out / "summary.json").read_text())
    for rank in range(2):
        text = seen.get(rank, "")
        # Its last scrape, during the linger, saw every step.
        assert re.search(rf'onebit_worker_steps{{[^}}]*rank="{rank}"[^}}]*}} 12\b', text), text
        assert re.search(r'onebit_worker_step_part_seconds_count{[^}]*part="wait"[^}]*} 12\b',
                         text), text
        assert 'role="worker"' in text and str(summary["job_id"]) not in text
        assert re.search(r"onebit_worker_loss{[^}]*} [0-9.e+-]+", text), text


def test_param_groups_lrs_become_the_servers_lr_scales():
    # The ratios to the first non-zero group's lr, as float32 (the servers'
    # multipliers); groups at one lr need none; a group without an lr among
    # differing ones, or a negative lr, is refused by name.
    sys.path.insert(0, os.path.join(BIN, "python"))
    from onebit_ps import OnebitError, _lr_scales
    w = [object()]
    assert _lr_scales([{"params": w}, {"params": w, "lr": 0.1}], 0.1) == [1.0, 1.0]
    assert _lr_scales([{"params": w}, {"params": w}], None) == [1.0, 1.0]
    scales = _lr_scales([{"params": w, "lr": 0.0}, {"params": w, "lr": 0.4},
                         {"params": w, "lr": 0.1}], None)
    assert scales == [0.0, 1.0, 0.25]
    assert _lr_scales([{"params": w, "lr": 0.3}, {"params": w, "lr": 0.1}], None)[1] == \
        pytest.approx(1 / 3, rel=1e-7)
    with pytest.raises(OnebitError, match=r"param group 1 has no lr while other groups have "
                                          r"different ones \(group 0: 0\.1, group 2: 0\.2\)"):
        _lr_scales([{"params": w, "lr": 0.1}, {"params": w}, {"params": w, "lr": 0.2}], None)
    with pytest.raises(OnebitError, match=r"param group 0 has lr -0\.1: want a finite lr >= 0"):
        _lr_scales([{"params": w, "lr": -0.1}, {"params": w, "lr": 0.2}], None)
