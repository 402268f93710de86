"""The front's state across jobs: torch's state_dict seeds a job, a job's
state_dict seeds another bit for bit, and a stopped or rolled-back job of
torch workers ends as the uninterrupted one."""
import os
import re
import subprocess

import pytest

from front_jobs import BIN, HERE, launch, summary_of


def seed_job(out, workers, servers, flags, args):
    cmd = [os.path.join(BIN, "onebit-launch"), f"--workers={workers}", f"--servers={servers}",
           "--model=external", "--weight_decay=0.01", "--lr=0.001", f"--out={out}",
           "--launch_register_timeout=30s",
           f"--worker_cmd=/usr/bin/python3 {HERE}/seed_worker.py {args}"] + flags
    if "--optimizer=zero-one-adam" not in flags:  # it has no such setting
        cmd.append("--bias_correction")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    return r, summary_of(out)


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
