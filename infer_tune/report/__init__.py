"""Reports built from result documents only: the combined leaderboard and the `compare` gate."""
