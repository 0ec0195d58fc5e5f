"""Other projects' tools, unchanged, each in a virtual environment of its own under
$TOKENBUS_HOME/peer-clients/<name>-<version>/, made on first use and reused after: the benchmark clients
(guidellm, aiperf), llm-compressor (which pins an older transformers than ours) and OpenVINO (its GenAI
runtime and optimum-intel's exporter, which pins an older transformers too):

    guidellm = client("guidellm")        # .../peer-clients/guidellm-0.8.1/bin/guidellm
    python = interpreter("llmcompressor")   # .../peer-clients/llmcompressor-0.14.0.1/bin/python
    exporter = client("openvino", "optimum-cli")   # .../peer-clients/openvino-2026.4.1/bin/optimum-cli

A client is the package of its name at its version, or the packages PACKAGES names for it.

The venv reads this environment's site-packages through a .pth file, so pip installs only what is
missing here (torch, transformers and tokenizers are found, not downloaded) and puts a client's own
versions of shared packages in the venv, where they shadow ours; ours are never touched. A constraints
file holds torch at the version installed here. A venv is complete when its marker, written last, names
the same client, Python and shared packages; anything else is made again from scratch."""
import hashlib
import json
import shutil
import subprocess
import sys
import sysconfig
import time
import venv
from importlib import metadata
from pathlib import Path

from filelock import FileLock

from workers.models.builder import tokenbus_home

CLIENTS = {"guidellm": "0.8.1", "aiperf": "0.13.0",   # pinned: a client's version is part of what its run says
           "llmcompressor": "0.14.0.1", "openvino": "2026.4.1"}
PACKAGES = {"openvino": ("openvino-genai==2026.4.1.0", "optimum-intel[openvino]==2.2.0")}   # several, or another name
HELD = ("torch",)                                     # never installed into a client's venv: ours is used
# Removed from a client's venv after pip installed them: PyPI's torchvision is built for PyPI's (CUDA) torch
# and cannot load beside our CPU torch, and transformers, finding it, fails to import; optimum-intel
# requires it for its vision models only.
DROPPED = {"openvino": ("torchvision",)}
MARKER = "tokenbus-peer-client.json"
INSTALL_TIMEOUT = 900.0


class InstallError(RuntimeError):
    """pip could not install a client; the message has pip's last lines."""


def client(name: str, command: str | None = None, log=print) -> Path:
    """The client's executable (`command`, by default its name), its venv made first unless it is complete."""
    return ready(name, log) / "bin" / (command or name)


def interpreter(name: str, log=print) -> Path:
    """The Python of the tool's venv (for a library without a command), made first unless complete."""
    return ready(name, log) / "bin" / "python"


def ready(name: str, log=print) -> Path:
    root = venv_dir(name)
    root.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{root}.lock"):
        if not complete(root, name):
            install(root, name, log)
    return root


def venv_dir(name: str) -> Path:
    return tokenbus_home() / "peer-clients" / f"{name}-{CLIENTS[name]}"


def specs(name: str) -> tuple[str, ...]:
    """What pip installs for the client: its pinned packages."""
    return PACKAGES.get(name, (f"{name}=={CLIENTS[name]}",))


def shared() -> list[str]:
    """This environment's site-packages folders, which a client's venv reads after its own."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def stamp(name: str) -> dict:
    """What a made venv depends on: the client's pin, this Python, and the packages it shares with us."""
    installed = sorted(p.name for d in shared() for p in Path(d).glob("*.dist-info"))
    return {"client": " ".join(specs(name)), "python": sys.version, "shared": shared(),
            "packages": hashlib.sha256("\n".join(installed).encode()).hexdigest()[:16]}


def complete(root: Path, name: str) -> bool:
    try:
        made = json.loads((root / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return {k: made.get(k) for k in stamp(name)} == stamp(name)


def install(root: Path, name: str, log=print) -> None:
    """A fresh venv at root that sees our packages, the pinned client installed into it with pip."""
    spec = " ".join(specs(name))
    log(f"installing {spec} into {root} (once; later runs reuse it)")
    start = time.monotonic()
    shutil.rmtree(root, ignore_errors=True)
    venv.EnvBuilder(with_pip=False).create(root)     # pip runs from this environment (pip --python)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(root), "platbase": str(root)}))
    (site / "_tokenbus_shared.pth").write_text("".join(f"{d}\n" for d in shared()))
    held = root / "constraints.txt"
    held.write_text("".join(f"{p}=={metadata.version(p)}\n" for p in HELD))
    pip = [sys.executable, "-m", "pip", "--python", str(root / "bin" / "python")]
    done = subprocess.run([*pip, "install", "--no-input", "--disable-pip-version-check", "-q", "-c", str(held),
                           *specs(name)], capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
    if done.returncode == 0 and name in DROPPED:
        done = subprocess.run([*pip, "uninstall", "-y", "-q", *DROPPED[name]], capture_output=True, text=True,
                              timeout=INSTALL_TIMEOUT)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise InstallError(f"pip could not install {spec} into {root} (exit {done.returncode}):\n{tail}")
    for p in HELD:
        assert not list(site.glob(f"{p}-*.dist-info")), f"pip installed its own {p} into {root}"
    seconds = round(time.monotonic() - start, 1)
    (root / MARKER).write_text(json.dumps({**stamp(name), "seconds": seconds}, indent=1))
    log(f"installed {spec} in {seconds} s")
