"""The background trainer: PPO-family algorithms, training backends and the asynchronous loop."""
