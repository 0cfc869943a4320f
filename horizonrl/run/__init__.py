"""A run's owners of heavy objects (learner, player, Ray cluster) and the run lock."""
