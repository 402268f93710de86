#!/usr/bin/env python3
"""deploy/slurm/onebit.sbatch on a real Slurm cluster of this machine
(tools/slurm-cluster: slurmctld and 3 slurmd, each in a network namespace
with a shaped link). Four jobs:

1. the mlp on Fashion-MNIST, 1 server node and 2 worker nodes of 2 workers:
   it finishes, replicas equal, it learned, and it ends bit for bit as the
   same job under onebit-launch;
2. three interruptions: scancel --batch --signal=TERM (what --signal=B:TERM@
   sends before the time limit) once a checkpoint is complete, and, each
   time it runs again past a newer one, scancel --signal=TERM (the steps'
   tasks), then scancel --full --signal=TERM (every process, as preemption,
   scancel and the time limit do: srun kills its tasks); the first two stop
   it with a checkpoint, the third fails it; each time it requeues itself
   and resumes, and it ends with every replica, master shard, server error
   and metrics row's loss equal to an uninterrupted run;
   its secret was 0600 in a 0700 folder while it ran, and is gone after;
3. job 2's config again, and a kill -9 of a worker once a checkpoint is
   complete: its task starts it again in place, the others roll back, and
   it ends equal to the uninterrupted run bit for bit, not requeued;
4. job 1 again on its finished run folder: refused (exit 78), not requeued.

Exit 77 (skipped, with the reason) where this is not root, network
namespaces cannot be made, or Slurm's or munge's binaries are missing.

    slurm_test.py SOURCE_DIR BIN_DIR WORK_DIR
"""
import csv
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

T0 = time.monotonic()


def log(msg):
    print(f"[{time.monotonic() - T0:6.1f} s] {msg}", flush=True)


def skip_reason():
    if os.geteuid() != 0:
        return "needs root (network namespaces, Slurm's daemons)"
    for b in ("ip", "tc", "unshare", "nsenter", "slurmctld", "slurmd", "sbatch", "munged"):
        if shutil.which(b) is None:
            return f"no {b} (tools/setup installs slurmctld, slurmd, slurm-client, munge)"
    probe = f"obsl-probe{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "cannot create a network namespace here (ip netns add failed)"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if any(line.split()[0].startswith("obsl-") for line in
           subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
           .stdout.splitlines() if line.strip()):
        return "a tools/slurm-cluster cluster is already up on this machine (its obsl-* namespaces)"
    return None


class Cluster:
    def __init__(self, source, folder):
        self.script = f"{source}/tools/slurm-cluster"
        self.dir = folder
        self.shared = f"{folder}/shared"

    def run(self, *args, check=True, env=None, timeout=60):
        r = subprocess.run([self.script, *args], capture_output=True, text=True, env=env,
                           timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"tools/slurm-cluster {' '.join(args)}: exit {r.returncode}\n"
                                 f"{r.stdout}{r.stderr}")
        return r

    def slurm(self, *args, env=None):
        return self.run("exec", "--dir", self.dir, *args, env=env).stdout

    def job(self, job_id):
        """scontrol show job as a dict (one line, key=value)."""
        text = self.slurm("scontrol", "-o", "show", "job", str(job_id))
        return dict(f.split("=", 1) for f in text.split() if "=" in f)

    def wait(self, job_id, what, until, timeout):
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if until(info):
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id}: {what}: not within {timeout} s "
                                     f"(state {info.get('JobState')}, {info.get('Reason')})")
            time.sleep(0.2)


def ended(info):
    return info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                    "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED")


def newest_checkpoint(folder):
    """The step of the newest complete checkpoint in folder (-1: none)."""
    steps = [int(d.split("-")[1]) for d in (os.listdir(folder) if os.path.isdir(folder) else [])
             if d.startswith("step-") and os.path.exists(f"{folder}/{d}/MANIFEST")]
    return max(steps, default=-1)


def wait_for_checkpoint(cluster, job_id, folder, after):
    """Waits until the running job has a complete checkpoint past step
    `after`; returns its step."""
    deadline = time.monotonic() + 60
    while (step := newest_checkpoint(folder)) <= after:
        info = cluster.job(job_id)
        assert not ended(info), f"job {job_id} ended before a checkpoint past step {after}"
        assert time.monotonic() < deadline, f"job {job_id}: no checkpoint past step {after} in 60 s"
        time.sleep(0.1)
    return step


def process_ids(namespace):
    r = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()]


def cmdline(pid):
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def floats(path):
    with open(path, "rb") as f:
        return f.read()


class Launch:
    """The uninterrupted reference: the same job under onebit-launch, started
    at once (it runs while Slurm's jobs wait), its summary from result()."""

    def __init__(self, bin_dir, out, flags):
        self.out, self.flags = out, flags
        self.log = open(f"{out}.log", "w")
        self.proc = subprocess.Popen(
            [f"{bin_dir}/onebit-launch", *flags, "--dump_params", f"--out={out}"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def result(self, timeout=180):
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"onebit-launch {self.flags}: not done within {timeout} s")
        if rc != 0:
            raise AssertionError(f"onebit-launch {self.flags}: exit {rc}\n"
                                 f"{open(self.log.name).read()[-3000:]}")
        return json.load(open(f"{self.out}/summary.json"))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def same_run(got_dir, want_dir, servers, workers):
    for name in ([f"master_s{k}" for k in range(servers)] +
                 [f"error_s{k}" for k in range(servers)] +
                 [f"replica_w{w}" for w in range(workers)]):
        got, want = floats(f"{got_dir}/{name}.f32"), floats(f"{want_dir}/{name}.f32")
        assert len(want) > 0 or name.startswith("error"), name
        assert got == want, f"{name}.f32 differs from the uninterrupted run's"
    got = [r["loss"] for r in csv.DictReader(open(f"{got_dir}/metrics.csv"))]
    want = [r["loss"] for r in csv.DictReader(open(f"{want_dir}/metrics.csv"))]
    assert got == want, "metrics.csv's losses differ from the uninterrupted run's"


def main():
    source, bin_dir, work = sys.argv[1], sys.argv[2], sys.argv[3]
    reason = skip_reason()
    if reason:
        print(f"SKIP: {reason}")
        return 77
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    # The cluster's folder: short (munge's socket path), outside the build tree.
    cluster = Cluster(source, tempfile.mkdtemp(prefix="onebit-slurm-test."))
    os.rmdir(cluster.dir)  # tools/slurm-cluster up makes it
    sbatch = f"{source}/deploy/slurm/onebit.sbatch"
    shared = cluster.shared
    refs = []
    try:
        cluster.run("up", "--dir", cluster.dir, "--nodes", "3", timeout=120)
        log("cluster up: slurmctld and 3 slurmd in network namespaces")

        def submit(env_extra, nodes, flags):
            env = dict(os.environ, ONEBIT_SHARED=shared, ONEBIT_BIN_DIR=bin_dir,
                       ONEBIT_DUMP_PARAMS="1", ONEBIT_REGISTER_TIMEOUT="60s", **env_extra)
            out = cluster.slurm("sbatch", "--parsable", f"--nodes={nodes}",
                                f"--output={shared}/job-%j.out", sbatch, *flags, env=env)
            return int(out.strip().split(";")[0])

        def job_log(job_id):
            return open(f"{shared}/job-{job_id}.out").read()

        # 1. The mlp, servers on their own node.
        mlp = ["--model=mlp", "--max_train=8192", "--max_test=2000", "--epochs=3", "--seed=1",
               "--optimizer=onebit-adam", "--freeze_step=30", "--lr=1e-3", "--bias_correction"]
        refs.append(Launch(bin_dir, f"{work}/mlp-ref", ["--workers=4", "--servers=1", *mlp]))
        t = time.monotonic()
        run1 = f"{shared}/mlp"
        j1 = submit({"ONEBIT_OUT": run1, "ONEBIT_SERVER_NODES": "1",
                     "ONEBIT_WORKERS_PER_NODE": "2"}, 3, mlp)
        info = cluster.wait(j1, "the mlp job ends", ended, 120)
        assert info["JobState"] == "COMPLETED", (info["JobState"], job_log(j1))
        s1 = json.load(open(f"{run1}/summary.json"))
        log(f"job 1 (mlp, 1 server node + 2 nodes of 2 workers): {s1['steps']} steps in "
            f"{time.monotonic() - t:.1f} s (the job itself {s1['wall_s']:.1f} s), "
            f"test accuracy {s1['test_accuracy']:.4f}")
        assert s1["status"] == "ok" and s1["replicas_equal"] is True, s1
        assert (s1["workers"], s1["servers"], s1["steps"]) == (4, 1, 96), s1
        assert s1["test_accuracy"] > 0.7, s1["test_accuracy"]
        # Every process advertised its own node's address.
        assert "tcp://10.78.0.11:5555" in open(f"{run1}/server0.log").read()
        ref1 = refs[0].result()
        assert s1["test_accuracy"] == ref1["test_accuracy"], (s1, ref1)
        same_run(run1, f"{work}/mlp-ref", 1, 4)
        log("job 1 equals onebit-launch's run of the same config bit for bit")

        # 2. Preemption: SIGTERM to the batch script once a checkpoint is complete.
        syn = ["--model=synthetic", "--dim=200000", "--steps=2000", "--seed=1",
               "--optimizer=onebit-adam", "--freeze_step=300", "--checkpoint_every=100"]
        run2, ckpt2 = f"{shared}/preempt", f"{shared}/preempt-checkpoints"
        refs.append(Launch(bin_dir, f"{work}/preempt-ref",
                           ["--workers=2", "--servers=2", *syn[:-1]]))
        t = time.monotonic()
        j2 = submit({"ONEBIT_OUT": run2, "ONEBIT_CHECKPOINT_DIR": ckpt2}, 2, syn)
        wait_for_checkpoint(cluster, j2, ckpt2, -1)
        state = f"{shared}/.onebit-slurm/{j2}"
        assert stat.S_IMODE(os.stat(f"{state}/secret").st_mode) == 0o600
        assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
        cluster.slurm("scancel", "--batch", "--signal=TERM", str(j2))
        log(f"job 2 (synthetic, 2 nodes of a server and a worker): SIGTERM after "
            f"{time.monotonic() - t:.1f} s")
        cluster.wait(j2, "requeued after the stop", lambda i: int(i.get("Restarts", 0)) >= 1, 60)
        stopped = json.load(open(f"{run2}/summary.json"))
        log(f"job 2 requeued: {stopped['status']}")
        assert stopped["status"].startswith("stopped: Slurm: SIGTERM"), stopped["status"]
        # Once it runs again past a newer checkpoint: SIGTERM to the steps'
        # tasks (scancel --signal=TERM, without --batch).
        first = stopped["stopped_at_step"]
        wait_for_checkpoint(cluster, j2, ckpt2, first)
        cluster.slurm("scancel", "--signal=TERM", str(j2))
        cluster.wait(j2, "requeued after the second stop",
                     lambda i: int(i.get("Restarts", 0)) >= 2, 60)
        stopped = json.load(open(f"{run2}/summary.json"))
        log(f"job 2 requeued again: {stopped['status']}")
        assert stopped["status"].startswith("stopped: SIGINT to "), stopped["status"]
        assert stopped["stopped_at_step"] > first, (stopped, first)
        # And past a newer one: SIGTERM to every process at once (scancel
        # --full; so do preemption, scancel and the time limit): srun kills
        # its tasks at once (SIGKILL), the job fails, and the script requeues
        # it (no failure of its own) to resume from its last periodic checkpoint.
        second = stopped["stopped_at_step"]
        periodic = wait_for_checkpoint(cluster, j2, ckpt2, second)
        cluster.slurm("scancel", "--full", "--signal=TERM", str(j2))
        cluster.wait(j2, "requeued after the failure",
                     lambda i: int(i.get("Restarts", 0)) >= 3, 90)
        failed = json.load(open(f"{run2}/summary.json"))
        log(f"job 2 requeued a third time: {failed['status']}")
        assert failed["status"].startswith("failed: "), failed["status"]
        info = cluster.wait(j2, "the resumed job ends", ended, 120)
        assert info["JobState"] == "COMPLETED", (info["JobState"], job_log(j2))
        assert int(info["Restarts"]) == 3, info["Restarts"]
        s2 = json.load(open(f"{run2}/summary.json"))
        log(f"job 2 resumed from step {s2['resumed_from_step']} and finished: "
            f"{time.monotonic() - t:.1f} s from submit, Slurm's requeue delays included")
        assert s2["status"] == "ok" and s2["replicas_equal"] is True, s2
        assert periodic <= s2["resumed_from_step"] < 2000, (s2, periodic)
        assert "job interrupted by Slurm's SIGTERM before its stop checkpoint" in job_log(j2)
        assert "job stopped after a checkpoint; requeueing" in job_log(j2)
        assert not os.path.exists(state), "the job's secret outlived it"
        refs[1].result()
        same_run(run2, f"{work}/preempt-ref", 2, 2)
        log("job 2 equals the uninterrupted run bit for bit")

        # 3. kill -9 of a worker once a checkpoint is complete: its task starts
        # it again in place, the others roll back, the job is not requeued.
        run3, ckpt3 = f"{shared}/kill9", f"{shared}/kill9-checkpoints"
        t = time.monotonic()
        j3 = submit({"ONEBIT_OUT": run3, "ONEBIT_CHECKPOINT_DIR": ckpt3}, 2, syn)
        wait_for_checkpoint(cluster, j3, ckpt3, -1)
        # Worker 1 runs on the allocation's second node, in its namespace.
        nodes = cluster.slurm("scontrol", "show", "hostnames", cluster.job(j3)["NodeList"])
        node = nodes.split()[1]
        victim = [p for p in process_ids(f"obsl-{node}")
                  if cmdline(p).startswith(f"{bin_dir}/onebit-worker")]
        assert len(victim) == 1, (node, victim)
        os.kill(victim[0], signal.SIGKILL)
        info = cluster.wait(j3, "the job ends after a kill -9", ended, 120)
        assert info["JobState"] == "COMPLETED", (info["JobState"], job_log(j3))
        assert int(info["Restarts"]) == 0, info["Restarts"]
        s3 = json.load(open(f"{run3}/summary.json"))
        assert s3["status"] == "ok" and s3["rollbacks"] == 1, s3
        assert "died (exit 137); starting it again (1)" in open(f"{run3}/worker1.log").read()
        same_run(run3, f"{work}/preempt-ref", 2, 2)
        log(f"job 3 (kill -9 of worker 1): started again in place, rolled back, finished in "
            f"{time.monotonic() - t:.1f} s, equal to the uninterrupted run bit for bit")

        # 4. A finished run folder is refused, and not requeued.
        t = time.monotonic()
        j4 = submit({"ONEBIT_OUT": run1, "ONEBIT_SERVER_NODES": "1",
                     "ONEBIT_WORKERS_PER_NODE": "2"}, 3, mlp)
        info = cluster.wait(j4, "the refused job ends", ended, 60)
        assert info["JobState"] == "FAILED" and info["ExitCode"] == "78:0", info
        assert int(info["Restarts"]) == 0, info
        assert "not requeued" in job_log(j4), job_log(j4)
        log(f"job 4 (a finished run folder) refused with exit 78 in {time.monotonic() - t:.1f} s")
        print(f"ok: 4 Slurm jobs in {time.monotonic() - T0:.1f} s")
        return 0
    finally:
        for ref in refs:
            ref.stop()
        # Keep what the jobs wrote for a failure's reader, then tear down.
        for sub in ("shared", "log"):
            if os.path.isdir(f"{cluster.dir}/{sub}"):
                shutil.copytree(f"{cluster.dir}/{sub}", f"{work}/cluster-{sub}", symlinks=True,
                                dirs_exist_ok=True)
        r = cluster.run("down", "--dir", cluster.dir, check=False)
        if r.returncode != 0:
            print(f"tools/slurm-cluster down: exit {r.returncode}\n{r.stderr}")


if __name__ == "__main__":
    sys.exit(main())
