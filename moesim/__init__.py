"""moesim: trace-driven simulation of speculative decoding on Mixture-of-Experts LLMs."""

__version__ = "0.1.0"
