"""A stand-in `sglang` package for the launcher's tests (`tests/support/fake_sglang_pkg`)."""
