"""Anthropic's Messages API: types, the adapter and its event stream, routes."""
