"""Serving: the continuous-batching engine (`engine.py`) that the HTTP and Triton faces drive."""
