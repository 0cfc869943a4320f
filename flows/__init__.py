"""Prefect flows: train (the iteration loop), and the CLI entry points."""
