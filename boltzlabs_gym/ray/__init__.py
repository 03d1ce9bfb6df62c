"""Workers placed, started, watched and cleaned up by a Ray cluster (``pip install "boltzlabs-gym[ray]"``).

>>> from boltzlabs_gym.ray import RayWorkers                               # doctest: +SKIP
>>> with RayWorkers(num_workers=4, capacity=256) as workers:               # doctest: +SKIP
...     pool = RLPool("./envs/code_env", n=1024, workers=workers)

Ray places one actor per worker (a placement group, SPREAD by default, or ``node_ids=``);
each actor starts a real ``boltzlabs-gym worker`` (:mod:`.actor`) and returns the address it
bound and its CURVE public key. Steps go trainer to worker over ZeroMQ with CURVE, never
through Ray; env code runs in the workers' sandboxes, never in a Ray process.
:class:`RayWorkers` is a :class:`~boltzlabs_gym.client.sources.WorkerSource`: pools and vector envs
take it as ``workers=``.
"""

from __future__ import annotations

from ..errors import MissingExtraError

try:
    import ray  # noqa: F401 - fail here, with the install line, rather than deep inside
except ImportError as exc:  # pragma: no cover - depends on the install
    raise MissingExtraError(
        'boltzlabs_gym.ray needs Ray: pip install "boltzlabs-gym[ray]" (or "ray[default]>=2.9")', "ray"
    ) from exc

from .actor import WorkerHost, worker_environment
from .workers import RayWorker, RayWorkers, StartupTimes

__all__ = ["RayWorkers", "RayWorker", "StartupTimes", "WorkerHost", "worker_environment"]
