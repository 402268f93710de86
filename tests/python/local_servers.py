"""What the worker scripts of these tests do to the servers that
onebit-launch started beside them (a preemption, a crash), and the ports
the tests give processes before they start."""
import os
import random
import socket
import sys


def free_local_port():
    """A loopback TCP port nothing holds now, below Linux's ephemeral range
    (32768 up) so that no outgoing connection is handed it meanwhile: for
    a process (gloo's MASTER_PORT) that must be told its port beforehand."""
    for _ in range(200):
        port = random.randint(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free loopback port in 20000-32000 after 200 draws")


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
