"""The protocol-neutral turn: render a prompt, pick the segment it extends, sample n choices,
parse tool calls and reasoning, commit them token-exact. Imports no protocol
(`gateway.protocols`), no route and no wiring (tests/unit/project/test_layers.py)."""
