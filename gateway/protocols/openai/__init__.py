"""OpenAI chat completions, completions and models: types, adapters, SSE, routes."""
