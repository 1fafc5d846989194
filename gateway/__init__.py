"""The OpenAI-compatible gateway as an HTTP service: routes, sessions, rewards, admin API, web
page. It imports no trainer module; `rlgateway/` composes it with the trainer."""
