"""The run's Ray cluster: joined once at the run's start when the run uses Ray, left at its end."""

from __future__ import annotations

from horizonrl.config import RayConfig, TrainConfig


class Cluster:
    """This process's membership of a Ray cluster (shards on ``rollout.runner: ray``, update ranks on
    ``update.launcher: ray``)."""

    def __init__(self) -> None:
        self._joined: RayConfig | None = None

    def join(self, cfg: TrainConfig) -> None:
        """Join the run's Ray cluster and stay, if the run uses one: ``ray.address``, or a new local cluster
        bound to 127.0.0.1 (``address="local"``, so a ``RAY_ADDRESS`` in the environment cannot redirect it),
        without the dashboard's modules (its API server stays, on 127.0.0.1)."""
        uses_ray = cfg.rollout.runner == "ray" or (cfg.update.launcher == "ray" and cfg.update.world_size > 1)
        if not uses_ray or self._joined == cfg.ray:
            return
        self.leave()
        import ray  # the optional "ray" extra

        if cfg.ray.address is not None:
            ray.init(address=cfg.ray.address, namespace="horizonrl")
        else:
            ray.init(
                address="local",
                num_cpus=cfg.ray.num_cpus,
                object_store_memory=cfg.ray.object_store_mb * 2**20,
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                namespace="horizonrl",
            )
        self._joined = cfg.ray

    def leave(self) -> None:
        """Leave the Ray cluster: a local one stops with all its processes (workers, raylet, GCS); a
        cluster given by address keeps running."""
        if self._joined is not None:
            import ray

            ray.shutdown()
            self._joined = None
