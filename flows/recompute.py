"""The ``recompute-advantages`` flow: any method's advantages over an earlier run's stored rollouts,
without new rollouts. Stateful estimators (BLPO) chain their state through the iterations in order,
starting empty, as they would have in a run of their own."""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from tasks.advantage import recompute_iteration


@flow(name="recompute-advantages")
def recompute_advantages(run_dir: str, method: str, params: dict | None = None) -> dict[int, str]:
    """Write ``advantages-<method>.parquet`` into every complete ``iter=<n>`` folder of ``run_dir``."""
    iterations = sorted(p for p in Path(run_dir).glob("iter=*") if (p / "episodes.parquet").is_file())
    if not iterations:
        raise ValueError(f"run_dir {run_dir!r} holds no stored iteration (iter=<n>/episodes.parquet)")
    written, state = {}, None
    for d in iterations:
        path, state, _ = recompute_iteration(str(d), method, params or {}, state)
        written[int(d.name.split("=")[1])] = path
    return written
