"""Reports the confinement it finds itself in (reset obs), and probes a path (step)."""

import errno
import os
import socket

from boltzlabs_gym.env import ENV_INDEX, WORKSPACE, serve


def _status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("CapEff", "CapPrm", "CapBnd", "NoNewPrivs", "Seccomp", "Threads"):
                out[k] = v.strip()
    return out


def _try(fn):
    try:
        fn()
        return "ok"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))


def reset(seed, options=None):
    marker = os.path.join(WORKSPACE, f"mine-{ENV_INDEX}")
    with open(marker, "w") as f:
        f.write("x")
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    return {
        "index": ENV_INDEX,
        "pid": os.getpid(),
        "uid": os.getuid(),
        "visible_pids": len(pids),
        "hostname": socket.gethostname(),
        "workspace": sorted(os.listdir(WORKSPACE)),
        "tcp": _try(lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM).connect(("127.0.0.1", 1))),
        "write_env": _try(lambda: open("/env/x", "w")),
        "unshare": _try(lambda: os.unshare(0x20000)) if hasattr(os, "unshare") else "n/a",
        "fds": sorted(int(x) for x in os.listdir("/proc/self/fd")),
        "status": _status(),
        "env_keys": sorted(os.environ),
        "environ": dict(os.environ),
        "mounts_ws": [l.split()[4] for l in open("/proc/self/mountinfo") if l.split()[4] == "/workspace"],
    }


def step(action):
    return {"listdir": _try(lambda: os.listdir(action))}, 0.0, False, {}


serve(reset=reset, step=step)
