"""OpenAI's Responses API: types, the adapter and its event stream, kept responses, routes."""
