"""Triton kernels, one per file, each with a torch reference (installed as `omniflow.kernels`)."""
