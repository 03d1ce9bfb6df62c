"""ZeroMQ CURVE keys for remote workers: generation and strict loading.

``boltzlabs-gym keygen ./keys`` writes two key pairs::

    keys/worker.key          worker public key     (give it to clients)
    keys/worker.key_secret   worker secret key     (stays on the worker host, mode 0600)
    keys/client.key          client public key     (the worker's allow-list)
    keys/client.key_secret   client secret key     (stays with the trainer, mode 0600)

A worker started with ``--keys DIR`` loads ``worker.key_secret`` and allows every
other ``*.key`` public key in ``DIR`` (add a file per extra client). A pool given
``keys=DIR`` loads ``client.key_secret`` and pins ``worker.key``. Missing, empty or
malformed keys raise :class:`KeyFileError`; nothing is silently skipped (pyzmq's own
loader only logs such errors and then denies everyone).

Keys need not be files: a launcher (``boltzlabs_gym.ray``) makes them in memory, hands a
worker its secret key and allowed client keys on its stdin (``--keys-stdin``, one line read
by :func:`parse_worker_keys_line`) and gives a pool a :class:`ClientKeys` (``keys=``).
:func:`write_client_keys` saves such keys for ``boltzlabs-gym status --keys DIR``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..errors import KeyFileError

__all__ = [
    "KeyFileError",
    "WorkerKeys",
    "ClientKeys",
    "generate_keys",
    "load_worker_keys",
    "load_client_keys",
    "parse_worker_keys_line",
    "write_client_keys",
]

WORKER_NAME = "worker"
CLIENT_NAME = "client"


@dataclass(frozen=True)
class WorkerKeys:
    public: bytes
    secret: bytes = field(repr=False)  # never in a log line or a traceback's locals
    allowed_clients: frozenset[bytes]


@dataclass(frozen=True)
class ClientKeys:
    public: bytes
    secret: bytes = field(repr=False)  # never in a log line, an EnvSpec or a traceback's locals
    server_public: bytes


def generate_keys(directory: str) -> dict[str, str]:
    """Create the worker and client key pairs in ``directory`` (secret files mode 0600)."""
    import zmq.auth

    os.makedirs(directory, exist_ok=True)
    written = {}
    for name in (WORKER_NAME, CLIENT_NAME):
        for suffix in (".key", ".key_secret"):
            path = os.path.join(directory, name + suffix)
            if os.path.exists(path):
                raise KeyFileError(f"{path} already exists; refusing to overwrite keys")
    old_umask = os.umask(0o077)
    try:
        for name in (WORKER_NAME, CLIENT_NAME):
            public, secret = zmq.auth.create_certificates(directory, name)
            os.chmod(secret, 0o600)
            os.chmod(public, 0o644)
            written[name] = public
            written[name + "_secret"] = secret
    finally:
        os.umask(old_umask)
    return written


def _load(path: str, want_secret: bool) -> tuple[bytes, bytes]:
    """The (public, secret) keys in ``path``; secret is ``b""`` in a public key file."""
    import zmq.auth

    if not os.path.isfile(path):
        raise KeyFileError(f"key file {path} does not exist (create keys with: boltzlabs-gym keygen DIR)")
    if os.path.getsize(path) == 0:
        raise KeyFileError(f"key file {path} is empty")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (ValueError, OSError) as exc:
        raise KeyFileError(f"key file {path} is malformed: {exc}") from None
    if not public or len(public) != 40:
        raise KeyFileError(f"key file {path} has no valid public key")
    if want_secret and (not secret or len(secret) != 40):
        raise KeyFileError(f"key file {path} has no secret key (use the .key_secret file)")
    return public, secret or b""


def load_worker_keys(directory: str) -> WorkerKeys:
    """The worker's key pair and its allow-list of client public keys."""
    public, secret = _load(os.path.join(directory, WORKER_NAME + ".key_secret"), want_secret=True)
    allowed = set()
    for name in sorted(os.listdir(directory)):
        if name.endswith(".key") and name != WORKER_NAME + ".key":
            client_public, _ = _load(os.path.join(directory, name), want_secret=False)
            allowed.add(client_public)
    if not allowed:
        raise KeyFileError(f"no client public keys (*.key besides worker.key) in {directory}: nobody could connect")
    return WorkerKeys(public, secret, frozenset(allowed))


def load_client_keys(directory: str) -> ClientKeys:
    """The client's key pair and the worker public key it pins."""
    public, secret = _load(os.path.join(directory, CLIENT_NAME + ".key_secret"), want_secret=True)
    server_public, _ = _load(os.path.join(directory, WORKER_NAME + ".key"), want_secret=False)
    return ClientKeys(public, secret, server_public)


def parse_worker_keys_line(line: str) -> WorkerKeys:
    """A worker's keys from one line of z85 keys: its secret key, then the allowed client public keys.

    What ``boltzlabs-gym worker --keys-stdin`` reads: nothing on a command line or in the
    environment, where other processes of the same user could read it.
    """
    import zmq
    import zmq.utils.z85

    words = line.split()
    if len(words) < 2:
        raise KeyFileError("--keys-stdin wants one line: the worker's z85 secret key, then allowed client public keys")
    keys = []
    for position, word in enumerate(words):
        # Checked whole (z85-decoded to 32 bytes) and never echoed: word 0 is a secret, and a
        # malformed client key would otherwise be accepted and admit nobody, silently.
        what = "the secret key" if position == 0 else f"client key {position}"
        try:
            key = word.encode("ascii")
            if len(key) != 40 or len(zmq.utils.z85.decode(key)) != 32:
                raise ValueError("not 40 characters")
        except (UnicodeError, ValueError, KeyError, TypeError):
            raise KeyFileError(f"--keys-stdin: {what} is not a 40-character z85 key") from None
        keys.append(key)
    try:
        public = zmq.curve_public(keys[0])
    except (ValueError, zmq.ZMQError):
        raise KeyFileError("--keys-stdin: the secret key is malformed") from None
    return WorkerKeys(public, keys[0], frozenset(keys[1:]))


def write_client_keys(directory: str, keys: ClientKeys) -> dict[str, str]:
    """Save in-memory client keys as a key directory ``load_client_keys`` (and ``boltzlabs-gym
    status --keys DIR``) reads: ``client.key_secret`` (mode 0600) and the pinned ``worker.key``.

    The directory is created mode 0700 and must not hold keys already.
    """
    os.makedirs(directory, mode=0o700, exist_ok=True)
    paths = {
        CLIENT_NAME + "_secret": os.path.join(directory, CLIENT_NAME + ".key_secret"),
        WORKER_NAME: os.path.join(directory, WORKER_NAME + ".key"),
    }
    for path in paths.values():
        if os.path.exists(path):
            raise KeyFileError(f"{path} already exists; refusing to overwrite keys")
    files = (
        (paths[CLIENT_NAME + "_secret"], keys.public, keys.secret, 0o600),
        (paths[WORKER_NAME], keys.server_public, b"", 0o644),
    )
    for path, public, secret, mode in files:
        quoted = {name: '"' + key.decode("ascii") + '"' for name, key in (("public", public), ("secret", secret))}
        lines = ["metadata", "curve", "    public-key = " + quoted["public"]]
        if secret:
            lines.append("    secret-key = " + quoted["secret"])
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.chmod(path, mode)
    return paths
