"""The code server over real HTTP: SandboxFusion's API, its errors, hostile programs, metrics,
and verl's own client module (from the verl wheel that .ci/run downloads) against it."""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
import socket
import time

import pytest

pytest.importorskip("fastapi")
requests = pytest.importorskip("requests")
uvicorn = pytest.importorskip("uvicorn")

from boltzlabs_gym.code import CodeRunner  # noqa: E402
from boltzlabs_gym.code.server import create_app  # noqa: E402
from boltzlabs_gym.wire.limits import Limits  # noqa: E402
from code_servers import serving, verl_sandbox_module  # noqa: E402
from conftest import ISOLATION  # noqa: E402


@pytest.fixture(scope="module")
def server():
    runner = CodeRunner(
        envs_per_lane=3,
        lanes=1,
        isolation=ISOLATION,
        limits=Limits(memory_bytes=384 << 20, file_size_bytes=32 << 20),
        max_run_timeout=30,
    )
    try:
        with serving(create_app(runner)) as url:
            yield url, runner
    finally:
        runner.close()


def post(url, **body):
    return requests.post(url + "/run_code", json=body, timeout=30)


def test_ping_status_and_a_run(server):
    url, runner = server
    assert requests.get(url + "/v1/ping").json() == "pong"
    status = requests.get(url + "/v1/status").json()
    assert status["isolation"]["backend"] == runner.isolation.backend and status["languages"]["python"] == {
        "available": True,
        "why_not": None,
    }
    assert status["python"] == runner.python
    assert status["languages"]["sql"] == {"available": False, "why_not": "SandboxFusion names it but has no runner for it"}
    # whether programs are wiped in place, and the cause where not, as the runner found it at start-up
    why_not = runner.wipe_unavailable
    assert status["wipe"] == ({"in_force": True} if why_not is None else {"in_force": False, "why_not": why_not})
    wiping = int(runner.wipe_unavailable is None)
    assert f"boltzlabs_code_wipe_in_force {wiping}.0" in requests.get(url + "/metrics").text
    r = post(url, code="import sys; print(sys.stdin.read().upper())", language="python", stdin="hi").json()
    assert r["status"] == "Success" and r["message"] == "" and r["compile_result"] is None
    assert r["run_result"]["stdout"] == "HI\n" and r["run_result"]["return_code"] == 0
    assert set(r) == {"status", "message", "compile_result", "run_result", "executor_pod_name", "files"}
    assert set(r["run_result"]) == {"status", "execution_time", "return_code", "stdout", "stderr"}


def test_sandboxfusion_answers_for_languages_and_bad_fields(server):
    url, _ = server
    swift = post(url, code="print(1)", language="swift").json()
    assert swift["status"] == "SandboxError" and "no Swift compiler in Debian 12" in swift["message"]
    assert "supported: python, " in swift["message"] and "swift" not in swift["message"].split("supported: ")[1]
    assert post(url, code="x", language="cobol").status_code == 422
    assert post(url, language="python").status_code == 422
    assert post(url, code="x", language="python", run_timeout=31).status_code == 422
    bad = requests.post(url + "/run_code", data="{bad", headers={"Content-Type": "application/json"})
    assert bad.status_code == 422 and bad.json()["detail"][0]["type"] == "json_invalid"


def test_sandbox_fusion_fetch_files_relative_and_absolute(server):
    """SandboxFusion's ``test_python_fetch_files`` over HTTP: a relative and an absolute file the
    program wrote come back under the names asked for (absolute paths: the namespaces backend);
    a request's files at SandboxFusion's absolute paths are there for the program; a path over the
    system is a SandboxError naming it."""
    url, runner = server
    if runner.isolation.backend != "namespaces":
        pytest.skip(f"absolute paths need the namespaces backend, not {runner.isolation.backend}")
    code = 'open("a.txt", "w").write("secret"); open("/mnt/b", "w").write("sauce");'
    r = post(url, code=code, language="python", run_timeout=5, fetch_files=["a.txt", "/mnt/b"]).json()
    assert r["status"] == "Success" and r["run_result"]["status"] == "Finished", r
    assert base64.b64decode(r["files"]["a.txt"]).decode() == "secret"
    assert base64.b64decode(r["files"]["/mnt/b"]).decode() == "sauce"
    given = {"/mnt/data/x.csv": base64.b64encode(b"a,b").decode()}
    read = post(url, code="print(open('/mnt/data/x.csv').read())", language="python", files=given).json()
    assert read["status"] == "Success" and read["run_result"]["stdout"] == "a,b\n", read
    bad = post(url, code="print(1)", language="python", files={"/etc/x": "eA=="}).json()
    assert bad["status"] == "SandboxError" and "'/etc/x'" in bad["message"] and "allowed" in bad["message"], bad


def test_full_queue_answers_504_with_retry_after(server):
    url, runner = server
    limit, runner.max_queue = runner.max_queue, 0
    try:
        r = post(url, code="print(1)", language="python")
    finally:
        runner.max_queue = limit
    assert r.status_code == 504 and r.headers["Retry-After"] == "1"  # the status verl retries
    assert _metric(url, 'boltzlabs_code_rejected_total{reason="queue_full"}') >= 1


def test_hostile_programs_and_metrics(server):
    url, _ = server
    programs = {
        "bomb": ("import os\nwhile True:\n    try: os.fork()\n    except OSError: pass\n", 1),
        "hog": ("x = []\nwhile True: x.append(bytearray(16 << 20))\n", 5),
        "disk": ("import itertools\nfor i in itertools.count(): open(f'f{i}', 'wb').write(b'0' * (32 << 20))\n", 1),
        "forever": (
            "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True: time.sleep(1)\n",
            1,
        ),
    }
    with __import__("concurrent.futures").futures.ThreadPoolExecutor(4) as ex:
        futures = {k: ex.submit(post, url, code=c, language="python", run_timeout=t) for k, (c, t) in programs.items()}
        answers = {k: f.result().json() for k, f in futures.items()}
    for name, a in answers.items():
        assert a["status"] == "Failed", (name, a)
    assert answers["hog"]["run_result"]["return_code"] in (-9, 1), answers["hog"]
    assert answers["forever"]["run_result"]["status"] == "TimeLimitExceeded"
    after = post(url, code="import os; print(os.listdir('.'))", language="python").json()
    assert after["run_result"]["stdout"] == "['main.py']\n"
    text = requests.get(url + "/metrics").text
    assert 'boltzlabs_code_runs_total{language="python",status="Failed"}' in text
    assert "boltzlabs_code_timeouts_total" in text and "boltzlabs_code_queue_wait_seconds_count" in text


def test_memory_limit_per_request(server):
    url, runner = server
    status = requests.get(url + "/v1/status").json()
    assert status["memory_limit_per_request"]["by"] == runner.memory_limit_by
    oom_before = _metric(url, 'boltzlabs_code_oom_kills_total{language="python"}')
    hog = "x = bytearray(128 << 20)\nfor i in range(0, len(x), 4096): x[i] = 1\nprint('ok')\n"
    with __import__("concurrent.futures").futures.ThreadPoolExecutor(2) as ex:
        small, big = ex.map(lambda mb: post(url, code=hog, language="python", memory_limit_MB=mb).json(), (64, 256))
    assert big["status"] == "Success" and big["run_result"]["stdout"] == "ok\n", big
    assert small["status"] == "Failed" and small["run_result"]["status"] == "Finished", small
    if runner.memory_limit_by == "rlimit":  # no cgroup here: the allocation fails under RLIMIT_AS
        assert "MemoryError" in small["run_result"]["stderr"]
    else:  # killed by the kernel's OOM killer, as in SandboxFusion's cgroup
        assert small["run_result"]["return_code"] == -9
        assert _metric(url, 'boltzlabs_code_oom_kills_total{language="python"}') == oom_before + 1
    again = post(url, code=hog, language="python").json()  # the sandbox's own limit is back (384 MiB)
    assert again["status"] == "Success", again


def test_a_client_that_leaves_drops_its_queued_run(server):
    url, runner = server
    before = runner.stats().cancelled
    slow = "import time; time.sleep(2)"
    with __import__("concurrent.futures").futures.ThreadPoolExecutor(4) as ex:
        busy = [ex.submit(post, url, code=slow, language="python") for _ in range(3)]
        time.sleep(0.3)
        with pytest.raises(requests.Timeout):
            requests.post(url + "/run_code", json={"code": "print(1)", "language": "python"}, timeout=0.5)
        assert all(f.result().json()["status"] == "Success" for f in busy)
    deadline = time.monotonic() + 5
    while runner.stats().cancelled == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert runner.stats().cancelled == before + 1


def _metric(url: str, sample: str) -> float:
    """The value of one sample (name and labels, as exposed) in the server's /metrics."""
    match = re.search(rf"^{re.escape(sample)} (\S+)$", requests.get(url + "/metrics").text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _processes_with(marker: str) -> list[str]:
    """Host pids whose command line or name holds ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read()
        except OSError:
            continue
        if marker in cmdline or marker in comm:
            found.append(pid)
    return found


def test_a_client_that_leaves_mid_run_kills_its_program(server):
    url, runner = server
    before = runner.stats()
    cancelled_before = _metric(url, "boltzlabs_code_cancelled_total")
    code = (
        "import ctypes, subprocess\n"
        "subprocess.Popen(['sleep', '771.25'])\n"  # a child, to be killed with the program
        "ctypes.CDLL(None).prctl(15, b'bzspin771', 0, 0, 0)\n"  # PR_SET_NAME: the program, found by name
        "while True: pass\n"
    )
    body = json.dumps({"code": code, "language": "python", "run_timeout": 30}).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as client:
        client.sendall(
            b"POST /run_code HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        started = time.monotonic()
        while not (_processes_with("bzspin771") and _processes_with("771.25")) and time.monotonic() - started < 10:
            time.sleep(0.05)
        assert _processes_with("bzspin771") and _processes_with("771.25"), "the program did not start"
        time.sleep(max(0.0, 0.5 - (time.monotonic() - started)))
    left = time.monotonic()  # the client is gone
    while (_processes_with("bzspin771") or _processes_with("771.25")) and time.monotonic() - left < 5:
        time.sleep(0.05)
    gone_after = time.monotonic() - left
    assert gone_after < 2.0, f"the program's processes outlived its client by {gone_after:.2f} s"
    after = post(url, code="print(7)", language="python").json()  # the same lane, the same first env
    assert after["status"] == "Success" and after["run_result"]["stdout"] == "7\n"
    stats = runner.stats()
    assert stats.cancelled == before.cancelled + 1 and stats.hard_resets > before.hard_resets
    assert stats.timeouts == before.timeouts  # it was killed, not timed out
    assert _metric(url, "boltzlabs_code_cancelled_total") == cancelled_before + 1


def test_verl_client_unchanged(server):
    url, _ = server
    verl = verl_sandbox_module()
    response, error = verl.call_sandbox_api(url + "/run_code", "print(input())", "7", 10, 5, 256)
    assert error is None and response["status"] == "Success" and response["run_result"]["stdout"] == "7\n"
    stdio = {"inputs": ["1 2\n", "3 4\n", "5 5\n"], "outputs": ["3\n", "7\n", "11\n"]}
    results, meta = verl.check_correctness(url + "/run_code", stdio, "a, b = map(int, input().split()); print(a + b)")
    assert results == [True, True, False] and [m["status"] for m in meta] == ["success", "success", "wrong_answer"]
    results, meta = verl.check_correctness(url + "/run_code", {"inputs": [""], "outputs": [""]}, "while True: pass", 1)
    assert results == [-3] and meta[0]["status"] == "timeout"
    results, _ = verl.check_correctness(url + "/run_code", {"inputs": [""], "outputs": [""]}, "raise SystemExit(2)")
    assert results == [-2]
    if importlib.util.find_spec("shutil") and __import__("shutil").which("g++"):
        cpp = '#include <iostream>\nint main(){int a;std::cin>>a;std::cout<<a*2<<"\\n";}'
        results, meta = verl.check_correctness(
            url + "/run_code", {"inputs": ["4"], "outputs": ["8"]}, cpp, language="cpp"
        )
        assert results == [True], meta
        results, meta = verl.check_correctness(
            url + "/run_code", {"inputs": ["4"], "outputs": ["8"]}, "int x(", language="cpp"
        )
        assert results == [-4] and meta[0]["status"] == "compile_error"
