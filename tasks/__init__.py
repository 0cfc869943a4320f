"""Prefect tasks, one module per stage. Thin: read references, call the library and methods, write,
log ``<stage>/<name>`` metrics to the run's MLflow run, return a reference (never a tensor or engine)."""
