"""`tokenbus quantize`: llm-compressor's oneshot (lab/quantize/oneshot.py) on a local checkpoint, run in
llm-compressor's own venv (lab.peers.clients: made once under $TOKENBUS_HOME, our torch shared), so its
pinned transformers never meets ours. The result is a compressed-tensors W4A16 checkpoint directory."""
import subprocess
from pathlib import Path

from lab.peers import clients
from workers.models import catalogue
from workers.models.builder import CORPUS

ONESHOT = Path(__file__).with_name("oneshot.py")


def main(args) -> None:
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"--out {out}: exists; give a new directory")
    model = Path(catalogue.resolve(args.model))
    if not (model.is_dir() and list(model.glob("*.safetensors"))):
        raise SystemExit(f"--model {args.model}: llm-compressor reads a safetensors checkpoint directory, "
                         f"not {model}")
    python = clients.interpreter("llmcompressor")
    command = [str(python), str(ONESHOT), str(model), str(out), "--method", args.method,
               "--group-size", str(args.group_size), "--samples", str(args.samples), "--seq-len", str(args.seq_len),
               "--n-grid", str(args.n_grid), "--text", str(args.text or CORPUS), "--threads", str(args.threads)]
    if args.symmetric:
        command.append("--symmetric")
    print(f"quantizing {model} -> {out} with llm-compressor ({args.method}, W4A16, group {args.group_size})")
    done = subprocess.run(command)
    if done.returncode != 0:
        raise SystemExit(f"llm-compressor's oneshot failed (exit {done.returncode}); its output is above")
