"""The OpenAI-compatible gateway: routes, sessions, rewards, admin API and the `rlgateway` CLI."""
