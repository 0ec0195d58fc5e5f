"""Peers: the engines a user could pick instead (llama.cpp, HF), built and driven on our workloads."""
