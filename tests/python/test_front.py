"""The PyTorch front on real clusters: onebit-launch --worker_cmd runs
torch_worker.py as every worker (coordinator, servers and workers are real
processes on 127.0.0.1)."""
import json
import os
import subprocess
import sys

import pytest

BIN = os.environ["ONEBIT_BIN_DIR"]
HERE = os.path.dirname(os.path.abspath(__file__))


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
    # A loss was reported every step, and it went down.
    assert s["final_loss"] is not None and s["final_loss"] < 1.5


def test_auto_freeze(tmp_path):
    r, s = launch(tmp_path, 2, 1, ["--optimizer=onebit-adam", "--freeze=auto:0.5:5", "--lr=0.01"],
                  "30")
    assert r.returncode == 0, r.stderr
    assert s["replicas_equal"] is True
    assert 0 < s["compress_steps"] < 30


def test_nan_gradient_is_an_exception_and_fails_the_job(tmp_path):
    r, s = launch(tmp_path, 2, 1, ["--optimizer=adam", "--lr=0.01"], "6 --nan_at 2")
    assert r.returncode != 0
    assert "torch_worker: step 2:" in r.stderr
    assert "non-finite" in r.stderr
    # Named as the user knows it: model[2].bias, element 1.
    assert "(parameter 2.bias[1])" in r.stderr
    assert s.get("status", "").startswith("failed")
