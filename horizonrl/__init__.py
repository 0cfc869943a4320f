"""horizonrl: critic-free RL for long-horizon LLM agents (library layer: envs, engines, store, config)."""

__version__ = "0.1.0"
