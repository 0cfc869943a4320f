"""The run's Ray cluster: joined once at the run's start when the run uses Ray, left at its end."""

from __future__ import annotations

from horizonrl.config import RayConfig


class Cluster:
    """This process's membership of the run's Ray cluster (shards on ``rollout.runner: ray``, update ranks on
    ``update.launcher: ray``), as section ``ray`` says."""

    def __init__(self, ray: RayConfig) -> None:
        self.ray = ray
        self.joined = False

    def join(self) -> None:
        """Join the run's Ray cluster and stay: ``ray.address``, or a new local cluster bound to 127.0.0.1
        (``address="local"``, so a ``RAY_ADDRESS`` in the environment cannot redirect it), without the
        dashboard's modules (its API server stays, on 127.0.0.1)."""
        if self.joined:
            return
        import ray  # the optional "ray" extra

        if self.ray.address is not None:
            ray.init(address=self.ray.address, namespace="horizonrl")
        else:
            ray.init(
                address="local",
                num_cpus=self.ray.num_cpus,
                object_store_memory=self.ray.object_store_mb * 2**20,
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                namespace="horizonrl",
            )
        self.joined = True

    def leave(self) -> None:
        """Leave the Ray cluster: a local one stops with all its processes (workers, raylet, GCS); a
        cluster given by address keeps running."""
        if self.joined:
            import ray

            ray.shutdown()
            self.joined = False
