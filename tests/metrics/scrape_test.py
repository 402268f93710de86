#!/usr/bin/env python3
"""A real Prometheus scrapes a running job's coordinator (onebit-launch
--metrics_port) and its HTTP API must then agree with the run folder:
steps, bytes per direction and phase, step-time counts, the compression
ratio of the last step, the job's end. Exit 77 (skipped) without Debian's
prometheus.

    scrape_test.py BIN_DIR WORK_DIR
"""
import csv
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    metrics_port, prom_port = free_port(), free_port()
    with open(f"{work}/prometheus.yml", "w") as f:
        f.write(f"""global:
  scrape_interval: 500ms
  scrape_timeout: 400ms
scrape_configs:
  - job_name: onebit
    static_configs:
      - targets: ['127.0.0.1:{metrics_port}']
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
            [f"{bin_dir}/onebit-launch", "--workers=2", "--servers=2", "--dim=200000",
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
        if job.wait(timeout=300) != 0:
            print(open(f"{work}/launch.log").read()[-5000:])
            raise AssertionError("the job failed")
        summary = json.load(open(f"{out}/summary.json"))
        rows = list(csv.DictReader(open(f"{out}/metrics.csv")))
        assert summary["job_id"] not in text
        secret = [os.path.join(out, n) for n in os.listdir(out) if "secret" in n]
        for path in secret:
            assert open(path, "rb").read().hex() not in text

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
                        one(prom_port, last("onebit_steps")) == steps):
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
        fp32 = 200000 * 4 * 2
        ratio = one(prom_port, last('onebit_compression_ratio{direction="up"}'))
        assert abs(ratio - int(rows[-1]["bytes_up"]) / fp32) < 1e-12, ratio
        assert ratio < 1 / 25, ratio
        assert one(prom_port, last("onebit_compression_phase")) == 1
        assert abs(one(prom_port, last("onebit_loss")) - float(rows[-1]["loss"])) <= \
            1e-8 * abs(float(rows[-1]["loss"]))  # the csv keeps 9 digits
        # Absent, not zero: nothing reported a test accuracy, no checkpoint.
        assert query(prom_port, last("onebit_test_accuracy_ratio")) == {}
        assert query(prom_port, last("onebit_checkpoint_last_step")) == {}
        print(f"ok: {steps} steps; bytes up {summary['bytes_up']}, down {summary['bytes_down']}; "
              f"ratio up {ratio:.4f}; {int(one(prom_port, 'count_over_time(onebit_steps[10m])'))} "
              "scrapes")
        return 0
    finally:
        prom.terminate()
        try:
            prom.wait(timeout=20)
        except subprocess.TimeoutExpired:
            prom.kill()


if __name__ == "__main__":
    sys.exit(main())
