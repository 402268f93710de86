#!/usr/bin/env python3
"""A real Prometheus scrapes a running job's coordinator, servers and
workers (onebit-launch --metrics_port: P, P+1.. the servers, then the
workers) and its HTTP API must then agree with the run folder: steps, bytes
per direction and phase (the coordinator's, the sum over the workers' and
over the servers'), step-time counts, the compression ratio of the last
step, the job's end. Exit 77 (skipped) without Debian's prometheus.

    scrape_test.py BIN_DIR WORK_DIR
"""
import csv
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from local_servers import free_local_ports  # noqa: E402  (ports below the ephemeral range)


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def query(prom, expr):
    """The instant vector `expr` as {labels-as-tuple: value}."""
    url = f"http://127.0.0.1:{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    reply = json.loads(get(url))
    if reply["status"] != "success":
        raise AssertionError(f"{expr}: {reply}")
    return {tuple(sorted(r["metric"].items())): float(r["value"][1])
            for r in reply["data"]["result"]}


def one(prom, expr):
    got = query(prom, expr)
    if len(got) != 1:
        raise AssertionError(f"{expr}: expected one series, got {got}")
    return next(iter(got.values()))


def main():
    bin_dir, work = sys.argv[1], sys.argv[2]
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        print("SKIP: no prometheus binary (tools/setup installs Debian's prometheus)")
        return 77
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    workers, servers = 2, 2
    metrics_port = free_local_ports(1 + servers + workers)
    prom_port = free_local_ports(1)
    targets = ", ".join(f"'127.0.0.1:{metrics_port + i}'" for i in range(1 + servers + workers))
    with open(f"{work}/prometheus.yml", "w") as f:
        f.write(f"""global:
  scrape_interval: 500ms
  scrape_timeout: 400ms
scrape_configs:
  - job_name: onebit
    static_configs:
      - targets: [{targets}]
""")
    prom = subprocess.Popen(
        [prometheus, f"--config.file={work}/prometheus.yml",
         f"--storage.tsdb.path={work}/tsdb", f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=open(f"{work}/prometheus.log", "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 60
        while True:
            try:
                if "Ready" in get(f"http://127.0.0.1:{prom_port}/-/ready", timeout=1):
                    break
            except OSError:
                pass
            if prom.poll() is not None or time.time() > deadline:
                print(open(f"{work}/prometheus.log").read()[-3000:])
                raise AssertionError("prometheus did not become ready")
            time.sleep(0.2)

        out = f"{work}/run"
        job = subprocess.Popen(
            [f"{bin_dir}/onebit-launch", f"--workers={workers}", f"--servers={servers}",
             "--dim=200000",
             "--steps=3000", "--optimizer=onebit-adam", "--freeze_step=300",
             f"--metrics_port={metrics_port}", "--metrics_linger=8s", f"--out={out}"],
            stdout=open(f"{work}/launch.log", "w"), stderr=subprocess.STDOUT)
        # While it runs: the endpoint answers, in Prometheus' text format,
        # and shows nothing of the job's identity or secret.
        text = None
        deadline = time.time() + 60
        while text is None and job.poll() is None and time.time() < deadline:
            try:
                text = get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=1)
            except OSError:
                time.sleep(0.1)
        assert text is not None, "the coordinator's metrics never answered"
        assert "# TYPE onebit_sent_bytes_total counter" in text, text[:2000]
        assert "# TYPE onebit_step_seconds histogram" in text, text[:2000]
        # So do the servers' and the workers' (labelled with their role and
        # shard or rank), once they have joined.
        texts = {}
        deadline = time.time() + 60
        while len(texts) < servers + workers and job.poll() is None and time.time() < deadline:
            for i in range(1, 1 + servers + workers):
                try:
                    # Empty until the process has joined (its shard or
                    # rank is not known before).
                    t = texts.get(i) or get(f"http://127.0.0.1:{metrics_port + i}/metrics",
                                            timeout=1)
                    if "onebit_" in t:
                        texts[i] = t
                except OSError:
                    pass
            time.sleep(0.1)
        assert len(texts) == servers + workers, f"answered: {sorted(texts)}"
        for k in range(servers):
            t = texts[1 + k]
            assert "# TYPE onebit_server_received_bytes_total counter" in t, t[:2000]
            assert "# TYPE onebit_server_apply_seconds histogram" in t, t[:2000]
            assert f'role="server",shard="{k}"' in t or f'shard="{k}"' in t, t[:2000]
        for r in range(workers):
            t = texts[1 + servers + r]
            assert "# TYPE onebit_worker_step_part_seconds histogram" in t, t[:2000]
            assert f'rank="{r}"' in t and 'role="worker"' in t, t[:2000]
        # A peer without the job's certificate (plaintext to the TLS port)
        # fails its handshake, twice: the coordinator counts them.
        m = re.search(r"coordinator: job \S+ on 127\.0\.0\.1:(\d+)", open(f"{work}/launch.log").read())
        assert m, open(f"{work}/launch.log").read()[-3000:]
        for _ in range(2):
            with socket.create_connection(("127.0.0.1", int(m.group(1))), timeout=5) as c:
                c.sendall(b"GET / HTTP/1.0\r\n\r\n")
                try:
                    c.recv(100)
                except OSError:
                    pass
        if job.wait(timeout=300) != 0:
            print(open(f"{work}/launch.log").read()[-5000:])
            raise AssertionError("the job failed")
        summary = json.load(open(f"{out}/summary.json"))
        rows = list(csv.DictReader(open(f"{out}/metrics.csv")))
        for t in [text] + list(texts.values()):
            assert summary["job_id"] not in t
        secret = [os.path.join(out, n) for n in os.listdir(out) if "secret" in n]
        for path in secret:
            for t in [text] + list(texts.values()):
                assert open(path, "rb").read().hex() not in t

        # Everything Prometheus kept, whatever it scraped last.
        def last(expr):
            return f"last_over_time({expr}[10m])"

        steps = int(summary["steps"])
        # Its scrapes during the linger saw the end (a loaded machine may
        # have delayed them: wait for them, bounded).
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if (one(prom_port, last("onebit_job_ended")) == 1 and
                        one(prom_port, last("onebit_steps")) == steps and
                        one(prom_port, f"sum({last('onebit_worker_steps')})") == workers * steps
                        and one(prom_port, f"sum({last('onebit_server_steps')})") ==
                        servers * steps):
                    break
            except AssertionError:
                pass
            time.sleep(0.5)
        assert steps == 3000 and len(rows) == steps
        assert one(prom_port, last("onebit_steps")) == steps
        assert one(prom_port, last("onebit_step_seconds_count")) == steps
        assert one(prom_port, last("onebit_rounds_total")) == steps
        assert one(prom_port, last("onebit_job_ended")) == 1
        assert one(prom_port, last('onebit_processes_expected{member="worker"}')) == 2
        # Scraped while it ran, not only at the end.
        assert one(prom_port, "count_over_time(onebit_steps[10m])") >= 3
        if summary["wall_s"] > 3:  # some 6 scrape intervals: one saw it mid-way
            assert one(prom_port, "min_over_time(onebit_steps[10m])") < steps
        for direction in ("up", "down"):
            for phase in ("warmup", "compress"):
                got = one(prom_port, last(
                    f'onebit_sent_bytes_total{{direction="{direction}",phase="{phase}"}}'))
                assert got == summary[f"bytes_{direction}_{phase}"], (direction, phase, got)
                want = sum(int(r[f"bytes_{direction}"]) for r in rows if r["phase"] == phase)
                assert got == want, (direction, phase, got, want)
        # The servers and workers, each on its own: every one did every
        # step; the bytes summed over them are the job's.
        for r in range(workers):
            w = f'rank="{r}"'
            assert one(prom_port, last(f"onebit_worker_steps{{{w}}}")) == steps
            assert one(prom_port, last(f"onebit_worker_step_seconds_count{{{w}}}")) == steps
            assert one(prom_port, last(f"onebit_worker_rounds_total{{{w}}}")) == steps
            assert query(prom_port, last(f"onebit_worker_local_steps_total{{{w}}}")) != {}
            assert one(prom_port, last(f"onebit_worker_local_steps_total{{{w}}}")) == 0
            for part in ("gradient", "push", "wait", "apply"):
                got = one(prom_port, last(
                    f'onebit_worker_step_part_seconds_count{{{w},part="{part}"}}'))
                assert got == steps, (r, part, got)
            # The parts are of the step, and within it: push + wait + apply
            # never exceed the step's time (plus the gradient computed
            # meanwhile: with overlap, pushes run during the backward).
            parts = sum(one(prom_port, last(
                f'onebit_worker_step_part_seconds_sum{{{w},part="{part}"}}'))
                for part in ("push", "wait", "apply"))
            total = one(prom_port, last(f"onebit_worker_step_seconds_sum{{{w}}}"))
            gradient = one(prom_port, last(
                f'onebit_worker_step_part_seconds_sum{{{w},part="gradient"}}'))
            assert 0 < parts <= total + gradient + 1e-6, (r, parts, total, gradient)
        for k in range(servers):
            s_ = f'shard="{k}"'
            assert one(prom_port, last(f"onebit_server_steps{{{s_}}}")) == steps
            assert one(prom_port, last(f"onebit_server_apply_seconds_count{{{s_}}}")) == steps
            assert one(prom_port, last(f"onebit_server_step_seconds_count{{{s_}}}")) == steps
            assert one(prom_port, last(f"onebit_server_compression_phase{{{s_}}}")) == 1
        # The coordinator refused the two handshakes and nothing else.
        coord = query(prom_port, last("onebit_refused_requests_total"))
        assert coord, "no onebit_refused_requests_total from the coordinator"
        assert one(prom_port, last('onebit_refused_requests_total{reason="tls_handshake"}')) >= 2
        for reason in ("unauthenticated", "malformed", "registration"):
            assert one(prom_port, last(f'onebit_refused_requests_total{{reason="{reason}"}}')) == 0
        # A clean job refused nothing, and says so for every reason.
        reasons = {"malformed", "wrong_job", "earlier_incarnation", "handshake", "wrong_key",
                   "wrong_step", "duplicate", "bad_payload", "lr_mismatch", "bad_seal"}
        refused = query(prom_port, last("onebit_server_refused_requests_total"))
        assert len(refused) == servers * len(reasons) and set(refused.values()) == {0}, refused
        assert {dict(k)["reason"] for k in refused} == reasons, refused
        for direction in ("up", "down"):
            for phase in ("warmup", "compress"):
                want = summary[f"bytes_{direction}_{phase}"]
                sel = f'direction="{direction}",phase="{phase}"'
                got = one(prom_port, "sum(" + last(f"onebit_worker_sent_bytes_total{{{sel}}}") + ")")
                assert got == want, ("workers", direction, phase, got, want)
                name = "received" if direction == "up" else "sent"
                sel = f'phase="{phase}"'
                got = one(prom_port, "sum(" + last(f"onebit_server_{name}_bytes_total{{{sel}}}") + ")")
                assert got == want, ("servers", direction, phase, got, want)
        fp32 = 200000 * 4 * 2
        ratio = one(prom_port, last('onebit_compression_ratio{direction="up"}'))
        assert abs(ratio - int(rows[-1]["bytes_up"]) / fp32) < 1e-12, ratio
        assert ratio < 1 / 25, ratio
        # Each worker's ratio is of its own bytes over 4·d.
        worker_ratio = one(prom_port,
                           "sum(" + last('onebit_worker_compression_ratio{direction="up"}') + ")")
        assert abs(worker_ratio * 200000 * 4 - int(rows[-1]["bytes_up"])) < 1e-6, worker_ratio
        # The loss each worker reported last; the coordinator's is their mean.
        mean_loss = one(prom_port, "avg(" + last("onebit_worker_loss") + ")")
        assert abs(mean_loss - float(rows[-1]["loss"])) <= 1e-6 * abs(mean_loss), mean_loss
        assert one(prom_port, last("onebit_compression_phase")) == 1
        assert abs(one(prom_port, last("onebit_loss")) - float(rows[-1]["loss"])) <= \
            1e-8 * abs(float(rows[-1]["loss"]))  # the csv keeps 9 digits
        # Absent, not zero: nothing reported a test accuracy, no checkpoint.
        assert query(prom_port, last("onebit_test_accuracy_ratio")) == {}
        assert query(prom_port, last("onebit_checkpoint_last_step")) == {}
        print(f"ok: {steps} steps; bytes up {summary['bytes_up']}, down {summary['bytes_down']} "
              f"(the coordinator's, the workers' and the servers' agree); ratio up {ratio:.4f}; "
              f"{int(one(prom_port, 'count_over_time(onebit_steps[10m])'))} scrapes of the "
              f"coordinator, {servers} servers and {workers} workers")
        return 0
    finally:
        prom.terminate()
        try:
            prom.wait(timeout=20)
        except subprocess.TimeoutExpired:
            prom.kill()


if __name__ == "__main__":
    sys.exit(main())
