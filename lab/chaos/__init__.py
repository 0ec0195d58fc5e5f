"""Chaos: fault scenarios against a live stack under a verified load, and the network namespaces they use."""
