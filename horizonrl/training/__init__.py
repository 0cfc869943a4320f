"""Training rows, the PPO trainer, checkpoints, behaviour cloning and demonstrations."""
