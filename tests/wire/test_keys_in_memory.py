"""Keys that never touch a file: a worker reading its keys on stdin (--keys-stdin), a pool given
ClientKeys, and in-memory keys saved for `boltzlabs-gym status` (what boltzlabs_gym.ray uses)."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest
import zmq

from boltzlabs_gym import KeyFileError, RLPool, WorkerError
from boltzlabs_gym.wire.keys import ClientKeys, load_client_keys, parse_worker_keys_line, write_client_keys

from conftest import COUNTER, ISOLATION

pytestmark = pytest.mark.usefixtures("no_leaks")


def _start(line: bytes) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "boltzlabs_gym.worker", "--bind", "tcp://127.0.0.1:*", "--keys-stdin"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    proc.stdin.write(line)
    proc.stdin.close()
    return proc, proc.stdout.readline().decode()


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(15)
    proc.stdout.close()
    proc.stderr.close()


def test_worker_takes_its_keys_on_stdin_and_admits_only_that_client():
    client_public, client_secret = zmq.curve_keypair()
    server_public, server_secret = zmq.curve_keypair()
    proc, ready = _start(server_secret + b" " + client_public + b"\n")
    try:
        assert ready.startswith("READY tcp://127.0.0.1:"), proc.stderr.read()
        address = ready.split()[1]
        worker = psutil.Process(proc.pid)
        secret = server_secret.decode()
        assert secret not in " ".join(worker.cmdline()) and secret not in str(worker.environ())
        keys = ClientKeys(client_public, client_secret, server_public)
        with RLPool(COUNTER, n=2, workers=[address], keys=keys, isolation=ISOLATION) as pool:
            assert pool.reset() == [{"t": 0}, {"t": 0}]
        other_public, other_secret = zmq.curve_keypair()
        with pytest.raises(WorkerError, match="rejected this client's key"):
            RLPool(COUNTER, n=1, workers=[address], keys=ClientKeys(other_public, other_secret, server_public),
                   heartbeat_timeout=3.0, isolation=ISOLATION)
    finally:
        _stop(proc)


@pytest.mark.parametrize("line, why", [
    (b"\n", "wants one line"),
    (b"tooshort somethingelse\n", "the secret key is not a 40-character z85 key"),
    ("é".encode() * 20 + b" " + b"x" * 40 + b"\n", "the secret key is not a 40-character z85 key"),
])
def test_worker_refuses_bad_key_lines(line, why):
    proc, ready = _start(line)
    try:
        assert ready == "" and proc.wait(15) == 2
        err = proc.stderr.read().decode()
        assert why in err
        assert "tooshort" not in err and "é" not in err  # a secret, however malformed, is never echoed
    finally:
        _stop(proc)


def test_parse_and_write_client_keys(tmp_path):
    public, secret = zmq.curve_keypair()
    server_public, server_secret = zmq.curve_keypair()
    keys = parse_worker_keys_line(f"{server_secret.decode()} {public.decode()}")
    assert keys.public == server_public and keys.allowed_clients == {public}
    with pytest.raises(KeyFileError):
        parse_worker_keys_line(server_secret.decode())  # nobody allowed
    client = ClientKeys(public, secret, server_public)
    paths = write_client_keys(str(tmp_path / "k"), client)
    assert load_client_keys(str(tmp_path / "k")) == client
    assert os.stat(paths["client_secret"]).st_mode & 0o777 == 0o600
    assert os.stat(tmp_path / "k").st_mode & 0o777 == 0o700
    with pytest.raises(KeyFileError, match="refusing to overwrite"):
        write_client_keys(str(tmp_path / "k"), client)
