"""Where the kernel tests run the Triton kernels: natively on a CUDA device when there is one
(run them with TRITON_INTERPRET=0 there), else on the CPU under Triton's interpreter. The
references always run on the CPU."""
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def on_device(fn, *args, **kwargs):
    """fn on DEVICE's copies of the tensor arguments, its tensor results back on the CPU."""
    move = lambda x: x.to(DEVICE) if isinstance(x, torch.Tensor) else x  # noqa: E731
    out = fn(*map(move, args), **{k: move(v) for k, v in kwargs.items()})
    back = lambda x: x.cpu() if isinstance(x, torch.Tensor) else x  # noqa: E731
    return tuple(map(back, out)) if isinstance(out, tuple) else back(out)
