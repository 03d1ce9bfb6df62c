"""``pool.timing``: where the time of the last call went, and running counts."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Timing:
    """Timing of the pool's last batched call, plus totals since creation.

    ``worker_ms`` is the time the batch took on the slowest worker (fan-out to the
    envs and back; on a local pool's direct lane, from the first request written to
    the envs to the last reply read); ``roundtrip_ms`` is the trainer's wall clock
    around the whole call. Their difference is the transport's share, never hidden inside either.

    >>> t = Timing(worker_ms=1.0, roundtrip_ms=1.4)
    >>> round(t.transport_ms, 3)
    0.4
    """

    worker_ms: float = 0.0
    roundtrip_ms: float = 0.0
    per_worker_ms: dict = field(default_factory=dict)
    stragglers: tuple = ()
    errors: tuple = ()
    calls: int = 0
    env_steps: int = 0
    total_stragglers: int = 0
    total_errors: int = 0

    @property
    def transport_ms(self) -> float:
        return max(0.0, self.roundtrip_ms - self.worker_ms)

    def after_batch(
        self, per_worker_ms: dict, roundtrip_ms: float, stragglers: tuple, errors: tuple, env_calls: int
    ) -> Timing:
        """The timing once one more batch of ``env_calls`` env calls came back.

        >>> Timing().after_batch({"w": 1.0}, 1.5, (3,), (), env_calls=8).env_steps
        8
        """
        return Timing(
            worker_ms=max(per_worker_ms.values(), default=0.0),
            roundtrip_ms=roundtrip_ms,
            per_worker_ms=per_worker_ms,
            stragglers=stragglers,
            errors=errors,
            calls=self.calls + 1,
            env_steps=self.env_steps + env_calls,
            total_stragglers=self.total_stragglers + len(stragglers),
            total_errors=self.total_errors + len(errors),
        )
