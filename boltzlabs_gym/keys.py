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
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import KeyFileError

__all__ = ["KeyFileError", "WorkerKeys", "ClientKeys", "generate_keys", "load_worker_keys", "load_client_keys"]

WORKER_NAME = "worker"
CLIENT_NAME = "client"


@dataclass(frozen=True)
class WorkerKeys:
    public: bytes
    secret: bytes
    allowed_clients: frozenset[bytes]


@dataclass(frozen=True)
class ClientKeys:
    public: bytes
    secret: bytes
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
