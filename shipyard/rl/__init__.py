"""The RL loop: configuration (`shipyard.rl.config`), the run directory and the loop that ties curriculum, rollouts,
trainer, weight sync, checkpoints and held-out evaluation together."""
