"""Who may use the code server, and how its clients share it: tokens in the three forms a client that
only takes a URL can send, 401 before any sandbox, the refusal to serve beyond loopback without a
token, verl's and SandboxFusion's own clients unchanged, and one client's burst waiting behind
another's few. A real server on a real socket, real sandboxes."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
requests = pytest.importorskip("requests")
pytest.importorskip("uvicorn")

from boltzlabs_gym.code import CodeRunner  # noqa: E402
from boltzlabs_gym.code.server import create_app  # noqa: E402
from boltzlabs_gym.code.server.auth import TOKEN_ENV, ClientTokens, check_bind, collect_tokens  # noqa: E402
from boltzlabs_gym.errors import AuthConfigError  # noqa: E402
from boltzlabs_gym.wire.limits import Limits  # noqa: E402
from code_servers import free_port, sandbox_fusion_client, serving, verl_sandbox_module  # noqa: E402
from conftest import ISOLATION, ROOT  # noqa: E402

TOKEN_A = "token-of-client-a-0123456789"
TOKEN_B = "token-of-client-b-9876543210"


@pytest.fixture(scope="module")
def server():
    runner = CodeRunner(
        envs_per_lane=2,
        lanes=1,
        isolation=ISOLATION,
        limits=Limits(memory_bytes=384 << 20),
        max_run_timeout=10,
    )
    try:
        with serving(create_app(runner, tokens={"a": TOKEN_A, "b": TOKEN_B})) as url:
            yield url, runner
    finally:
        runner.close()


def with_token(url: str, token: str = TOKEN_A, user: str = "trainer") -> str:
    """``url`` with basic auth in it: ``http://user:TOKEN@host:port``."""
    return url.replace("http://", f"http://{user}:{token}@", 1)


def run(url: str, code: str = "print(6 * 7)", **kwargs) -> requests.Response:
    return requests.post(url + "/run_code", json={"code": code, "language": "python"}, timeout=30, **kwargs)


def metric(url: str, sample: str) -> float:
    text = requests.get(url + "/metrics", headers={"Authorization": f"Bearer {TOKEN_A}"}).text
    match = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def sandbox_uses(runner: CodeRunner) -> tuple:
    """What any run that reached a sandbox would have changed."""
    s = runner.stats()
    return sum(s.runs.values()), s.wipes, s.hard_resets, s.cancelled, s.queued, s.running


# ------------------------------------------------------------------------------------------ refused
def test_missing_or_wrong_token_gets_401_before_any_sandbox(server):
    url, runner = server
    before, unauthorized = sandbox_uses(runner), metric(url, 'boltzlabs_code_rejected_total{reason="unauthorized"}')
    wrong_basic = "Basic " + base64.b64encode(b"trainer:not-the-token").decode()
    refused = [
        run(url),
        run(url, headers={"Authorization": "Bearer not-the-token"}),
        run(url, headers={"Authorization": wrong_basic}),
        run(with_token(url, "not-the-token")),
        run(url, params={"token": "not-the-token"}),
        run(url, headers={"Authorization": f"Token {TOKEN_A}"}),  # a scheme it does not take
        # malformed JSON without a token: 401, not 422: the body was never read
        requests.post(url + "/run_code", data="{bad", headers={"Content-Type": "application/json"}),
        requests.get(url + "/v1/status"),
        requests.get(url + "/metrics"),
        requests.get(url + "/docs"),
    ]
    for r in refused:
        assert r.status_code == 401, (r.request.url, r.status_code, r.text)
        challenges = r.headers["WWW-Authenticate"]  # (requests joins the two headers with ", ")
        assert challenges.startswith("Bearer realm=") and "Basic realm=" in challenges
    assert "token" in refused[0].json()["detail"]
    assert requests.get(url + "/v1/ping").json() == "pong"  # the health check stays open
    assert sandbox_uses(runner) == before
    after = metric(url, 'boltzlabs_code_rejected_total{reason="unauthorized"}')
    assert after == unauthorized + len(refused)
    status = requests.get(url + "/v1/status", headers={"Authorization": f"Bearer {TOKEN_B}"}).json()
    assert status["unauthorized"] == after and status["auth"]["required"] and status["auth"]["clients"] == 2


# ------------------------------------------------------------------------------------------ let in
def test_bearer_basic_in_the_url_and_query_tokens_let_in(server):
    url, _ = server
    forms = {
        "bearer": run(url, headers={"Authorization": f"Bearer {TOKEN_A}"}),
        "basic in the URL": run(with_token(url, TOKEN_B)),
        "query": run(url, params={"token": TOKEN_B}),
    }
    for form, r in forms.items():
        assert r.status_code == 200, (form, r.text)
        assert r.json()["run_result"]["stdout"] == "42\n", form


def test_verl_client_unchanged_with_the_token_in_its_url(server):
    url, _ = server
    verl = verl_sandbox_module()
    # verl posts to the URL it is given, headers of its own only: basic auth in the URL, or ?token=
    for sandbox_url in (with_token(url) + "/run_code", url + f"/run_code?token={TOKEN_B}"):
        response, error = verl.call_sandbox_api(sandbox_url, "print(input())", "7", 10, 5, 256)
        assert error is None and response["run_result"]["stdout"] == "7\n", (sandbox_url, error)
        stdio = {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}
        results, _ = verl.check_correctness(sandbox_url, stdio, "a, b = map(int, input().split()); print(a + b)")
        assert results == [True, True]
    response, error = verl.call_sandbox_api(url + "/run_code", "print(1)", "", 10, 5, 256)
    assert response is None and "401" in error


def test_sandbox_fusion_client_unchanged_with_the_token_in_its_url(server):
    url, _ = server
    sandbox_fusion = sandbox_fusion_client()
    request = sandbox_fusion.RunCodeRequest(code="print(input()[::-1])", stdin="abc", language="python")
    # it builds {endpoint}/run_code and sets no header: only basic auth in the endpoint carries a token
    reply = sandbox_fusion.run_code(request, endpoint=with_token(url), max_attempts=1)
    assert reply.status == "Success" and reply.run_result.stdout == "cba\n"
    reply = asyncio.run(sandbox_fusion.run_code_async(request, endpoint=with_token(url, TOKEN_B), max_attempts=1))
    assert reply.status == "Success" and reply.run_result.stdout == "cba\n"
    with pytest.raises(Exception, match="401"):
        sandbox_fusion.run_code(request, endpoint=url, max_attempts=1)


# ------------------------------------------------------------------------------------------ sharing
def test_a_burst_waits_behind_another_clients_few(server):
    """Client a queues 40 slow-ish programs; then b queues 4. b's 4 are taken in turn with a's, so
    they finish while most of a's burst still waits (first in, first out they would finish last)."""
    url, runner = server
    finished: list[str] = []
    lock = threading.Lock()

    def post(client: str, token: str, i: int) -> None:
        code = f"import time; time.sleep(0.15); print('{client}{i}')"
        r = run(url, code, headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200 and r.json()["run_result"]["stdout"] == f"{client}{i}\n", r.text
        with lock:
            finished.append(client)

    runs_before = sum(runner.stats().runs.values())
    with concurrent.futures.ThreadPoolExecutor(44) as pool:
        burst = [pool.submit(post, "a", TOKEN_A, i) for i in range(40)]

        def a_all_in() -> bool:  # every one of a's 40 is queued, running or done
            s = runner.stats()
            return s.queued_by_client.get("a", 0) + s.running + sum(s.runs.values()) - runs_before >= 40

        deadline = time.monotonic() + 30
        while not a_all_in():
            assert time.monotonic() < deadline, runner.stats()
            time.sleep(0.01)
        with lock:
            a_done_first = len(finished)
        assert runner.stats().queued_by_client.get("a", 0) >= 30  # b joins behind a real burst
        few = [pool.submit(post, "b", TOKEN_B, i) for i in range(4)]
        for f in burst + few:
            f.result()
    after_b_joined = finished[a_done_first:]
    last_b = max(i for i, client in enumerate(after_b_joined) if client == "b")
    a_before_last_b = after_b_joined[:last_b].count("a")
    # In turns: a's 2 running, then a, b, a, b, ... b's last is taken 8th; say 12 of a's at most
    # for the answers' jitter. First in, first out: all of a's (~38) would come first.
    assert a_before_last_b <= 12, after_b_joined
    assert after_b_joined[last_b + 1 :].count("a") >= 20, after_b_joined


@contextlib.contextmanager
def queue_closed_for(runner: CodeRunner, seconds: float):
    """No client may queue (a bound of 0 each) for the first ``seconds`` of the block."""
    bound, runner.max_queue_per_client = runner.max_queue_per_client, 0
    reopen = threading.Timer(seconds, lambda: setattr(runner, "max_queue_per_client", bound))
    reopen.start()
    try:
        yield
    finally:
        reopen.cancel()
        runner.max_queue_per_client = bound


CLIENT_QUEUE_FULL = 'boltzlabs_code_rejected_total{reason="client_queue_full"}'


def test_a_full_queue_answers_504_with_retry_after(server):
    url, runner = server
    rejected = metric(url, CLIENT_QUEUE_FULL)
    with queue_closed_for(runner, 60):
        r = run(url, headers={"Authorization": f"Bearer {TOKEN_A}"})
    assert r.status_code == 504 and r.headers["Retry-After"] == "1", r.text
    assert "max_queue_per_client=0" in r.json()["detail"]
    assert metric(url, CLIENT_QUEUE_FULL) == rejected + 1


def test_verl_retries_a_full_queue(server):
    """verl's call_sandbox_api retries a 504 (and no other status) after 1 s: by then there is room."""
    url, runner = server
    verl = verl_sandbox_module()
    rejected = metric(url, CLIENT_QUEUE_FULL)
    with queue_closed_for(runner, 0.5):
        response, error = verl.call_sandbox_api(with_token(url) + "/run_code", "print(5)", "", 10, 5, 256)
    assert error is None and response["run_result"]["stdout"] == "5\n", error
    assert metric(url, CLIENT_QUEUE_FULL) == rejected + 1  # turned away once, then let in


def test_sandbox_fusion_retries_a_full_queue(server):
    """SandboxFusion's client retries any failure (tenacity, the first wait 1 to 2 s)."""
    url, runner = server
    sandbox_fusion = sandbox_fusion_client()
    rejected = metric(url, CLIENT_QUEUE_FULL)
    request = sandbox_fusion.RunCodeRequest(code="print(6)", language="python")
    with queue_closed_for(runner, 0.5):
        reply = sandbox_fusion.run_code(request, endpoint=with_token(url), max_attempts=3)
    assert reply.run_result.stdout == "6\n"
    assert metric(url, CLIENT_QUEUE_FULL) == rejected + 1


# ------------------------------------------------------------------------------------------ starting
def test_only_loopback_may_be_served_without_a_token(caplog):
    for host in ("127.0.0.1", "127.3.2.1", "localhost", "::1", "[::1]", "::ffff:127.0.0.1"):
        check_bind(host, tokens=0, insecure=False)
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.org", ""):
        with pytest.raises(AuthConfigError, match="--insecure-no-auth"):
            check_bind(host, tokens=0, insecure=False)
        check_bind(host, tokens=1, insecure=False)
    with caplog.at_level(logging.WARNING, logger="boltzlabs_gym.code.server"):
        check_bind("0.0.0.0", tokens=0, insecure=True)
    assert [r.getMessage() for r in caplog.records] == [
        "serving 0.0.0.0 WITHOUT a token (--insecure-no-auth): anyone who can reach it can run code here"
    ]
    with pytest.raises(AuthConfigError, match="both"):
        check_bind("0.0.0.0", tokens=1, insecure=True)


def test_tokens_are_checked_when_the_server_is_made():
    assert ClientTokens(TOKEN_A).clients == ["token-1"]  # one token as a string, not its characters
    assert ClientTokens([TOKEN_A, TOKEN_B]).client_of(TOKEN_B) == "token-2"
    with pytest.raises(AuthConfigError, match="same token"):
        ClientTokens({"a": TOKEN_A, "b": TOKEN_A})
    for bad in ("", "two words-0123456789", "tab\there-0123456789", "ünïcode-token-0123456789"):
        with pytest.raises(AuthConfigError):
            ClientTokens([bad])


def test_tokens_come_from_flags_the_environment_and_files(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# the trainers\ncarol  token-of-carol-0123456789\n\ntoken-unnamed-0123456789  # a comment\n")
    path.chmod(0o600)
    tokens = collect_tokens(["token-flag-0123456789"], "token-env-0123456789", [str(path)])
    assert tokens == {
        "token-1": "token-flag-0123456789",
        "token-2": "token-env-0123456789",
        "carol": "token-of-carol-0123456789",
        "token-3": "token-unnamed-0123456789",
    }
    (tmp_path / "empty").write_text("# nothing\n")
    (tmp_path / "three").write_text("a b c\n")
    for bad, match in (("empty", "holds no token"), ("three", "NAME TOKEN"), ("absent", "cannot read")):
        with pytest.raises(AuthConfigError, match=match):
            collect_tokens([], None, [str(tmp_path / bad)])


def code_server_cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    environ = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    return subprocess.Popen(
        [sys.executable, "-m", "boltzlabs_gym.cli", "code-server", *args],
        env={**environ, **(env or {})},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.usefixtures("no_leaks")
def test_the_cli_refuses_a_non_loopback_address_without_a_token():
    refusals = {
        ("--host", "0.0.0.0"): "refusing to serve 0.0.0.0 without a token",
        ("--host", "0.0.0.0", "--insecure-no-auth", "--token", TOKEN_A): "were both given",
    }
    for args, why in refusals.items():
        proc = code_server_cli(*args, "--port", str(free_port()))
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 2 and why in err, (out, err)
        assert "code server:" not in out  # no runner, no sandbox was started


@pytest.mark.usefixtures("no_leaks")
def test_the_cli_serves_every_token_it_is_given_and_no_other(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("carol token-of-carol-0123456789\n")
    path.chmod(0o600)
    port = free_port()
    proc = code_server_cli(
        *("--port", str(port), "--lanes", "1", "--envs-per-lane", "1", "--isolation", ISOLATION),
        *("--token", TOKEN_A, "--token-file", str(path)),
        env={TOKEN_ENV: TOKEN_B},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            try:
                if requests.get(url + "/v1/ping", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                time.sleep(0.1)
        for token in (TOKEN_A, TOKEN_B, "token-of-carol-0123456789"):
            r = requests.get(url + "/v1/status", headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 200 and r.json()["auth"]["clients"] == 3
            assert r.json()["max_queue_per_client"] == 1024 // 3  # an even share of --max-queue each
        assert run(url, params={"token": TOKEN_B}).json()["run_result"]["stdout"] == "42\n"
        assert run(url).status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)  # uvicorn's shutdown closes the runner and its worker
        proc.communicate(timeout=60)
