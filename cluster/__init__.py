"""spec-cluster: a speculative-decoding LLM serving cluster on Ray Serve."""

__version__ = "0.1.0"
