"""Imports point down: lower packages never import the modules built on them (no package cycles)."""

import ast
from pathlib import Path

import hierspec

SOURCE = Path(hierspec.__file__).parent

#: package -> hierspec modules it must not import (directly or inside a function)
FORBIDDEN = {
    "datastore": ("hierspec.drafters", "hierspec.methods", "hierspec.calibration", "hierspec.decode",
                  "hierspec.bench", "hierspec.server", "hierspec.cli", "hierspec.store_builds"),
    "drafters": ("hierspec.calibration", "hierspec.methods", "hierspec.bench", "hierspec.server", "hierspec.cli",
                 "hierspec.store_builds", "hierspec.decode"),
    "runtime": ("hierspec.target", "hierspec.drafters", "hierspec.datastore", "hierspec.methods",
                "hierspec.calibration", "hierspec.decode"),
}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_lower_packages_do_not_import_upward():
    offenders = []
    for package, forbidden in FORBIDDEN.items():
        files = sorted((SOURCE / package).glob("*.py"))
        assert files, package
        for path in files:
            for name in _imports(path):
                if any(name == f or name.startswith(f + ".") for f in forbidden):
                    offenders.append(f"{package}/{path.name} imports {name}")
    assert offenders == []
