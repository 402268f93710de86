"""What the worker scripts of these tests do to the servers that
onebit-launch started beside them (a preemption, a crash)."""
import os
import sys


def signal_server(shard, sig):
    """Sends `sig` to the onebit-server of `shard` started by this worker's
    parent (onebit-launch started both); exits when there is none."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if (ppid == os.getppid() and argv[0].endswith(b"onebit-server")
                and f"--shard={shard}".encode() in argv):
            os.kill(int(pid), sig)
            return
    sys.exit(f"{os.path.basename(sys.argv[0])}: server {shard} not found")
