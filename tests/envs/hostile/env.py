"""A hostile env: the action says what to attack. Every attack reports what it managed.

  {"spin": true}                 burn the CPU forever inside step
  {"daemon": marker}             double-fork, setsid, exec ``sleep <marker>``: try to outlive the env
  {"close_channel": "stay"}      close every fd but stderr (the reply channel included), keep running
  {"close_channel": "exit"}      the same, then exit with status 0
  {"read": path}                 read a file (e.g. /proc/<worker pid>/environ, another env's workspace)
  {"listdir": path}              list a directory
  {"signal": pid}                send signal 0 to a pid (can it even see it?)
  {"write": name}                write a file into its own workspace
Any other action: a plain step.
"""

import os
import time

from boltzlabs_gym.env import ENV_INDEX, WORKSPACE, serve


def _attempt(fn):
    try:
        return {"ok": True, "result": fn()}
    except Exception as exc:  # noqa: BLE001 - the attack failing is the expected outcome
        return {"ok": False, "error": type(exc).__name__, "message": str(exc)[:200]}


def _read(path):
    with open(path, "rb") as f:
        return f.read(4096).decode("utf-8", "replace")


def _daemonize(marker):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork() == 0:
            os.write(w, str(os.getpid()).encode())
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            os.execvp("sleep", ["sleep", marker])
        os._exit(0)
    os.waitpid(pid, 0)
    os.close(w)
    return int(os.read(r, 64))


def _close_channel(then):
    for fd in range(0, 256):
        if fd != 2:
            try:
                os.close(fd)
            except OSError:
                pass
    if then == "exit":
        os._exit(0)
    time.sleep(3600)


def reset(seed):
    return {"index": ENV_INDEX, "seed": seed}


def step(action):
    obs = {"index": ENV_INDEX}
    if isinstance(action, dict):
        if action.get("spin"):
            while True:
                pass
        if "daemon" in action:
            obs["daemon_pid"] = _daemonize(action["daemon"])
        if "close_channel" in action:
            _close_channel(action["close_channel"])
        if "read" in action:
            obs["read"] = _attempt(lambda: _read(action["read"]))
        if "listdir" in action:
            obs["listdir"] = _attempt(lambda: sorted(os.listdir(action["listdir"])))
        if "signal" in action:
            obs["signal"] = _attempt(lambda: os.kill(action["signal"], 0))
        if "write" in action:
            with open(os.path.join(WORKSPACE, action["write"]), "w") as f:
                f.write(f"secret of env {ENV_INDEX}")
            obs["workspace"] = os.path.realpath(WORKSPACE)
        obs["environ"] = sorted(os.environ)
    return obs, 1.0, False, {}


serve(reset=reset, step=step)
