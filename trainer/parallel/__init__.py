"""How a training backend lays its model over ranks: five parallel dimensions.

`strategy.py` is the typed strategy and its one-line allocation form (`fsdp:d2t2`; pydantic, no
torch, so a run config with a bad one fails at load), and the checks against a world size and a
model; `mesh.py` builds the torch `DeviceMesh` of a strategy; `tensor.py` splits a Hugging Face
decoder over the tensor mesh (DTensor), and `vocab.py` computes logprobs and entropies from logits
split over the vocabulary; `context.py` cuts a packed row into the context ranks' slices and
gathers their per-position results, and `ulysses.py` is the attention that trades tokens for
heads around the per-sequence kernel; `expert.py` splits an MoE model's experts over the expert
groups and sends tokens to them and back in all-to-alls.
"""
