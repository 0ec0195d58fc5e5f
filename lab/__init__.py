"""The lab: benchmarks, the capacity simulator and its fidelity check, chaos scenarios and the peers'
builds. It measures the product and may import any of it; nothing in the product imports the lab
(tests/test_layers.py holds that as import contracts)."""
