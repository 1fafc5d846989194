"""Training backends: who owns the policy's weights and optimizer (FSDP2 now; Megatron later).

`base.py` is the seam, `config.py` the typed settings (no torch import), `registry.py` the
factory, and one module per implementation.
"""
