"""Whether a ``/metrics`` port can be bound: checked by a pool before it starts its local worker, so a
port in use is a plain error at the pool's constructor rather than a worker that fails to start.

In ``wire/`` because the pool must not import the worker's Prometheus module to ask."""

from __future__ import annotations

from ..errors import MetricsPortError


def check_port(port: int, host: str = "127.0.0.1") -> None:
    """Raise :class:`~boltzlabs_gym.errors.MetricsPortError` if ``host:port`` cannot be bound now
    (checked before a local worker starts, so the pool can say so plainly; 0 always passes)."""
    import socket

    if type(port) is not int or not 0 <= port < 65536:
        raise ValueError(f"metrics_port must be an int in [0, 65535], got {port!r}")
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the HTTP server binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise MetricsPortError(
                f"metrics_port {port} on {host} is not free: {exc.strerror or exc} "
                "(choose another, or 0 for a free one)",
                port=port,
                host=host,
            ) from None
