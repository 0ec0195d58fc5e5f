"""`tokenbus quantize`, registered through the entry-point group tokenbus.commands: its parser only, the
run imported when chosen."""
import argparse
import os

from ops.args import MODEL, delegate
from ops.models import DEFAULT_MODEL


def grid(text: str) -> int:
    n = int(text)
    if n < 3:    # llm-compressor's duo-scaling grid divides by n - 2
        raise argparse.ArgumentTypeError(f"{n}: at least 3")
    return n


def quantize(sub) -> None:
    q = sub.add_parser("quantize", help="a W4A16 compressed-tensors checkpoint made by llm-compressor (AWQ, GPTQ or "
                                        "round-to-nearest), calibrated on the CPU on the text shipped with "
                                        "tokenbus; the engine serves it quantized")
    q.add_argument("--model", default=DEFAULT_MODEL, help=f"{MODEL} (a safetensors checkpoint; default: "
                                                          f"{DEFAULT_MODEL})")
    q.add_argument("--out", required=True, metavar="DIR", help="where the checkpoint is written (must not exist)")
    q.add_argument("--method", choices=["awq", "gptq", "rtn"], default="awq",
                   help="awq: activation-aware scales then rounding (default); gptq: error-compensating "
                        "rounding; rtn: round to nearest, no calibration")
    q.add_argument("--group-size", type=int, default=64, help="inputs sharing one scale and zero point; must divide "
                                                             "every linear's inputs (default: 64)")
    q.add_argument("--symmetric", action="store_true", help="no zero points (default: asymmetric, as AWQ)")
    q.add_argument("--samples", type=int, default=32, help="calibration windows of the text (default: 32)")
    q.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window (default: 512)")
    q.add_argument("--n-grid", type=grid, default=20, help="awq: scale grid points searched per layer, at least 3 "
                                                           "(default: 20, llm-compressor's)")
    q.add_argument("--text", metavar="FILE", help="calibration text (default: the Python docstrings corpus "
                                                  "shipped with tokenbus, not the text eval ppl scores)")
    q.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    q.set_defaults(func=delegate("lab.quantize.run"))
