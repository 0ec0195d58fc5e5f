"""Benchmarks: each runs our code and a baseline side by side and prints the ratios."""
