"""The packages form the layers `jaxgpt/__init__.py` lists: no module imports from a layer listed after its own.

The layer table is read from that docstring, so the documented order and the enforced one are the same text. Every
import counts, those inside functions too (a deferred import still makes the lower layer depend on the upper).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import jaxgpt

PACKAGE = Path(jaxgpt.__file__).parent
LAYER_LINE = re.compile(r"^    ([a-z_]+(?:, [a-z_]+)*) {2,}\S")  # "    ops        the kernels ..." in the docstring


def layers() -> dict[str, int]:
    """Each top-level package or module of jaxgpt to its layer's rank, bottom first."""
    rank: dict[str, int] = {}
    for line in (jaxgpt.__doc__ or "").splitlines():
        if match := LAYER_LINE.match(line):
            below = len(set(rank.values()))
            rank |= dict.fromkeys(match.group(1).split(", "), below)
    return rank


def unit(module: Path) -> str:
    """The top-level package (or module) of jaxgpt a source file belongs to."""
    return module.relative_to(PACKAGE).parts[0].removesuffix(".py")


def imported_units(module: Path) -> set[str]:
    """The top-level packages of jaxgpt that `module` imports anywhere in its body."""
    found = set()
    for node in ast.walk(ast.parse(module.read_text(), str(module))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name.split(".")[1] for name in names if name.startswith("jaxgpt.")}
    return found


def test_the_docstring_lists_every_package_once() -> None:
    rank = layers()
    on_disk = {unit(p) for p in PACKAGE.rglob("*.py")} - {"__init__", "__main__"}
    assert set(rank) == on_disk


def test_no_module_imports_from_a_layer_above_its_own_or_beside_it() -> None:
    rank = layers()
    wrong = []
    for module in sorted(PACKAGE.rglob("*.py")):
        own = unit(module)
        if own in ("__init__", "__main__"):  # the package's front door runs the commands, the top layer
            continue
        for other in imported_units(module) - {own}:
            # one layer's packages stand side by side (serve and tools; storage reads errors, the one exception)
            if rank[other] > rank[own] or (rank[other] == rank[own] and (own, other) != ("storage", "errors")):
                wrong.append(f"{module.relative_to(PACKAGE.parent)} imports jaxgpt.{other}")
    assert not wrong, wrong


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    module = tmp_path / "probe.py"
    module.write_text("def f():\n    from jaxgpt.tasks import build\n    import jaxgpt.serve.app\n")
    assert imported_units(module) == {"tasks", "serve"}
