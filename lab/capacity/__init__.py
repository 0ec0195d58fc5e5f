"""Capacity: the fleet simulator, its CPU cost fit and the check of its fidelity against real runs."""
