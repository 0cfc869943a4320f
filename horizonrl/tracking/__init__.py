"""MLflow runs, traces, the results report, the registered policy model and the episode view."""
