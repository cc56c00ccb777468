"""The rollout side: episodes (task → sandbox → agent → patch → grade → `Rollout`), the scheduler (groups, seeds,
advantages, dynamic sampling, bounded staleness), engine routing, the in-process and Ray transports, and `eval`."""
