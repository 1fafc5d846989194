"""Inference engines behind one async protocol (`engines.base.Engine`), and the tiny-model builder.

`engines` imports neither `gateway` nor `trainer`. Importing this package is cheap: torch and
transformers are imported by the modules that need them (`engines.local`, `engines.tiny_model`).
"""
