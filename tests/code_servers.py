"""A code server on a real socket for the tests, and the clients that only take its URL, unchanged:
verl's SandboxFusion module (from the verl wheel .ci/run downloads) and the ``sandbox-fusion`` package."""

from __future__ import annotations

import contextlib
import glob
import os
import socket
import threading
import time
import types
import zipfile
from collections.abc import Iterator

import pytest

from conftest import ROOT

VERL_DIST = os.environ.get("BOLTZLABS_VERL_DIST_DIR", os.path.join(ROOT, ".cache", "verl-dist"))
VERL_MODULE = "verl/utils/reward_score/sandbox_fusion/utils.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(app, host: str = "127.0.0.1") -> Iterator[str]:
    """Serve the ASGI ``app`` with uvicorn on a thread; yields its base URL once ``/v1/ping`` answers."""
    import requests
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if requests.get(url + "/v1/ping", timeout=1).json() == "pong":
                break
        except requests.ConnectionError:
            time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(10)


def verl_sandbox_module() -> types.ModuleType:
    """verl's ``sandbox_fusion/utils.py`` alone, unchanged, from its wheel (skips without it)."""
    wheels = sorted(glob.glob(os.path.join(VERL_DIST, "verl-*.whl")))
    if not wheels:
        pytest.skip(
            f"verl's wheel is not in {VERL_DIST}: python -m pip download --no-deps verl==0.9.1 -d .cache/verl-dist"
        )
    with zipfile.ZipFile(wheels[-1]) as z:
        source = z.read(VERL_MODULE).decode()
    module = types.ModuleType("verl_sandbox_fusion_utils")
    module.__file__ = f"{wheels[-1]}/{VERL_MODULE}"
    exec(compile(source, module.__file__, "exec"), module.__dict__)  # verl's module alone, unchanged
    return module


def sandbox_fusion_client() -> types.ModuleType:
    """SandboxFusion's official client (the ``sandbox-fusion`` package; skips without it)."""
    return pytest.importorskip("sandbox_fusion", reason="the sandbox-fusion package: pip install sandbox-fusion")
