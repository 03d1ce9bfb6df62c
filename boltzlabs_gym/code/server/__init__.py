"""A code-execution server speaking SandboxFusion's HTTP API over sandboxed pools (the ``server`` extra).

``boltzlabs-gym code-server --host 127.0.0.1 --port 8080`` serves ``POST /run_code``,
``GET /v1/ping``, ``GET /v1/status`` and ``GET /metrics``; :func:`create_app` builds the same
FastAPI app around a :class:`~boltzlabs_gym.code.CodeRunner` of your own. See docs/code-server.md.
"""

from .app import create_app

__all__ = ["create_app"]
