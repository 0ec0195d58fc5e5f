"""The import contracts of pyproject.toml ([tool.importlinter]) hold on the tree, and `lint-imports` sees
each of them broken: in a copy of the packages with one deliberate violation per contract (a service
importing another, a bench room importing another's benchmark, the worker importing a service, an
operator tool importing the lab, schemas importing the bus and nats), every contract is reported broken,
naming the module that broke it."""
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[1]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
VIOLATIONS = {                   # a module the copy gets -> what it imports
    "services/router/violation.py": "services.gateway",
    "lab/peers/violation.py": "lab.benchmarks.load",
    "workers/violation.py": "services.gateway",
    "ops/violation.py": "lab.common.results",
    "schemas/violation.py": "bus",
    "schemas/connects.py": "nats",
}


def lint(root: Path) -> subprocess.CompletedProcess:
    """lint-imports on the packages under root (its working directory, first on its path)."""
    return subprocess.run([str(Path(sys.executable).with_name("lint-imports")), "--no-cache"], cwd=root,
                          env={**os.environ, "COLUMNS": "200"}, capture_output=True, text=True, timeout=120)


def python_only(folder: str, names: list[str]) -> set[str]:
    return {n for n in names if n == "__pycache__" or (not n.endswith(".py") and not Path(folder, n).is_dir())}


def test_the_tree_keeps_every_import_contract():
    run = lint(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"Contracts: {len(CONFIG['contracts'])} kept, 0 broken." in run.stdout


def test_a_deliberate_violation_of_each_contract_is_reported_broken(tmp_path):
    for package in CONFIG["root_packages"]:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=python_only)
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for path, imported in VIOLATIONS.items():
        (tmp_path / path).write_text(f"import {imported}  # a deliberate violation\n")
    run = lint(tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    for contract in CONFIG["contracts"]:
        assert f"{contract['name']} BROKEN" in run.stdout
    for path, imported in VIOLATIONS.items():
        assert f"{path.removesuffix('.py').replace('/', '.')} -> {imported}" in run.stdout
    assert f"Contracts: 0 kept, {len(CONFIG['contracts'])} broken." in run.stdout
