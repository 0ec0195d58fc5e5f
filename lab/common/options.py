"""What the lab's commands say alike in their parsers."""
from ops.args import MODEL

BENCH_MODEL = f"{MODEL} (default: tiny, random weights: it measures the machinery, not a language model)"
