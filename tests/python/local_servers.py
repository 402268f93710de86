"""What the worker scripts of these tests do to the servers that
onebit-launch started beside them (a preemption, a crash), and the ports
the tests give processes before they start."""
import os
import random
import socket
import sys


def free_local_ports(count):
    """The first of `count` consecutive loopback TCP ports nothing holds now,
    below Linux's ephemeral range (32768 up). Below it, no outgoing
    connection is handed one of them meanwhile, and a client polling a port
    before its server listens cannot connect to itself (a self-connected
    socket echoes the request back as its reply)."""
    for _ in range(200):
        first = random.randint(20000, 32000 - count)
        held = []
        try:
            for port in range(first, first + count):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
        return first
    raise RuntimeError(f"no {count} consecutive free loopback ports in 20000-32000 after 200 draws")


def free_local_port():
    """One port as free_local_ports: for a process (gloo's MASTER_PORT) that
    must be told its port beforehand."""
    return free_local_ports(1)


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
