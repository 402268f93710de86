"""The PyTorch front on real clusters: onebit-launch --worker_cmd runs
torch_worker.py as every worker; the replicas, the summary and torch's own
optimizer agree; the front also joins a job started by hand with torchrun's
environment and serves its metrics."""
import json
import os
import re
import subprocess
import sys
import time

import pytest

from front_jobs import BIN, HERE, launch, learned


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


def test_local_ranks_of_torch_workers_push_once_and_end_equal(tmp_path):
    # 2 workers of 2 local ranks: 4 torch processes, each on its own data
    # (data_rank); a worker's two add their gradients and push once. Every
    # process's parameters end equal to every other's and to the masters,
    # and the servers saw 2 pushes per step.
    r, s = launch(tmp_path, 2, 2, ["--optimizer=onebit-adam", "--freeze_step=5", "--lr=0.01",
                                   "--local_ranks=2", "--dump_params"], "12")
    assert r.returncode == 0, r.stderr
    assert s["replicas_equal"] is True and s["workers"] == 2
    run = tmp_path / "run"
    files = ["replica_w0.f32", "replica_w0_local1.f32", "replica_w1.f32", "replica_w1_local1.f32"]
    dumps = {f: (run / f).read_bytes() for f in files}
    assert len(dumps["replica_w0.f32"]) == 4 * s["params"]
    assert len(set(dumps.values())) == 1, "the processes' parameters differ"
    masters = (run / "master_s0.f32").read_bytes() + (run / "master_s1.f32").read_bytes()
    assert masters == dumps["replica_w0.f32"]
    assert "[worker1.1] torch_worker: rank 1.1 final loss" in r.stderr
    assert learned(r.stderr, s), r.stderr


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


def test_worker_programs_get_their_share_of_the_cores_and_finish_ends_their_threads(tmp_path):
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
    # finish() ends the worker's threads and closes its sockets: left to the
    # program's exit, they went on calling the coordinator after the job
    # had ended (failed TLS handshakes in a successful job's log, now and
    # then a crash at exit).
    counts = re.findall(r"env_worker: threads and sockets before init \((\d+), (\d+)\), joined "
                        r"\((\d+), (\d+)\), after finish \((\d+), (\d+)\)", r.stderr)
    assert len(counts) == 2, r.stderr
    for c in counts:
        threads0, sockets0, threads1, sockets1, threads2, sockets2 = map(int, c)
        assert threads1 > threads0 and sockets1 > sockets0, c  # the worker's, while it runs
        assert (threads2, sockets2) == (threads0, sockets0), c
    assert "grpc" not in r.stderr, r.stderr


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


@pytest.mark.parametrize("local_ranks", [1, 2])
def test_workers_with_torchruns_environment_join_a_coordinator_given_once(tmp_path, local_ranks):
    """Without onebit-launch: a coordinator and a server started by hand, and
    two processes with the environment torchrun gives them (RANK,
    WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT);
    ONEBIT_COORDINATOR is the one thing the user adds: two workers, or with
    ONEBIT_LOCAL_RANKS=2 one worker of two local ranks (--local_ranks 2).
    (Debian 12's torchrun itself, torch 1.13 on Python 3.11, fails before it
    starts a process, so the test sets what it would.)"""
    workers = 2 // local_ranks
    port_file = tmp_path / "port"
    out = tmp_path / "run"
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("coordinator", "server")}
    coordinator = subprocess.Popen(
        [os.path.join(BIN, "onebit-coordinator"), f"--workers={workers}",
         f"--local_ranks={local_ranks}", "--servers=1",
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
                    LOCAL_WORLD_SIZE=str(local_ranks), MASTER_ADDR="127.0.0.1",
                    MASTER_PORT="29500",
                    PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(BIN, "python"),
                                                             os.environ.get("PYTHONPATH")])))
        if local_ranks > 1:
            base.update(ONEBIT_LOCAL_RANKS=str(local_ranks))
        processes = [subprocess.Popen(
            ["/usr/bin/python3", os.path.join(HERE, "torch_worker.py"), "30"],
            env=dict(base, RANK=str(r), LOCAL_RANK=str(r % local_ranks)),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
        procs += processes
        outputs = []
        for w in processes:
            outputs.append(w.communicate(timeout=240)[0])
            assert w.returncode == 0, outputs[-1][-3000:]
        assert coordinator.wait(timeout=60) == 0, (tmp_path / "coordinator.log").read_text()
        assert procs[0].wait(timeout=60) == 0, (tmp_path / "server.log").read_text()
    finally:
        for p in procs + [coordinator]:
            if p.poll() is None:
                p.kill()
                p.wait()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok"
    assert summary["workers"] == workers and summary["steps"] == 30
    assert summary["replicas_equal"] and summary["workers_agree"]
    assert summary["freeze_step"] == 5
    log = (tmp_path / "coordinator.log").read_text()
    assert "worker 0 registered" in log, log
    assert ("worker 1 registered" in log) == (workers == 2), log
    if local_ranks > 1:  # RANK 1 is worker 0's local rank 1 (RANK // 2, LOCAL_RANK)
        assert "torch_worker: rank 0.1 final loss" in outputs[1], outputs[1][-3000:]


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
