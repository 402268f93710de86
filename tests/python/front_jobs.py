"""What the PyTorch front's tests share: the job they start through
onebit-launch (coordinator, servers and torch workers as real processes on
127.0.0.1) and how they read what it left."""
import json
import os
import re
import subprocess

BIN = os.environ["ONEBIT_BIN_DIR"]
HERE = os.path.dirname(os.path.abspath(__file__))


def summary_of(out):
    """The job's summary.json as a dict; {} where the job wrote none."""
    path = out / "summary.json"
    return json.loads(path.read_text()) if path.exists() else {}


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
    return r, summary_of(out)

