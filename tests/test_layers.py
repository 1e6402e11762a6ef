"""The layers of kvbus (ARCHITECTURE.md): a module never imports one from a higher layer,
nor from a sibling layer it is independent of. Read from the source (every import,
including those inside functions; not those under ``if TYPE_CHECKING:``, which never
run), with transports/ and connectors/ under the names they install as
(kvbus.transports, kvbus.connectors)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS: list[set[str]] = [  # highest first; a set's members are independent of each other
    {"kvbus.cli"},
    {"kvbus.sim"},
    {"kvbus.service", "kvbus.ops"},
    {"kvbus.connectors"},
    {"kvbus.routing"},
    {"kvbus.metrics"},
    {"kvbus.bus"},
    {"kvbus.transports"},
    {"kvbus.wire"},
    {"kvbus.config", "kvbus.logs", "kvbus.shutdown", "kvbus._version"},
]
OUTSIDE = {"kvbus", "kvbus._moved"}
"""The package's front door (it imports the public names) and the old-name finder."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] in ("transports", "connectors"):
        parts.insert(0, "kvbus")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def placed(module: str) -> tuple[int, str] | None:
    """(layer, the group in it) that ``module`` belongs to, highest layer first."""
    for i, layer in enumerate(LAYERS):
        for name in layer:
            if module == name or module.startswith(name + "."):
                return i, name
    return None


def imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) for every import that runs, ``from kvbus import x`` as kvbus.x."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "kvbus":
                found.extend((node.lineno, f"kvbus.{alias.name}") for alias in node.names)
            else:
                found.append((node.lineno, node.module))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def violations(module: str, tree: ast.AST) -> list[str]:
    here = placed(module)
    if here is None:
        return [] if module in OUTSIDE else [f"{module} is in no layer (add it to LAYERS)"]
    found = []
    for line, target in imports(tree):
        if target != "kvbus" and not target.startswith("kvbus."):
            continue
        there = placed(target)
        if there is None:
            if target == "kvbus._moved":
                continue
            # The package itself, or a name it exports (``kvbus.subscribe``): the
            # public API is the delivery layer's (Publisher, subscribe, the events).
            target, there = "kvbus.bus", placed("kvbus.bus")
            assert there is not None
        # Above, or beside in the same layer but another (independent) group.
        if there[0] < here[0] or (there[0] == here[0] and there[1] != here[1]):
            found.append(f"{module}:{line} imports {target}")
    return found


def sources() -> list[Path]:
    return sorted(
        p for folder in ("kvbus", "transports", "connectors") for p in (ROOT / folder).rglob("*.py")
    )


def test_no_module_imports_a_higher_layer() -> None:
    found = [
        v for path in sources() for v in violations(module_name(path), ast.parse(path.read_text()))
    ]
    assert found == []


def test_the_check_catches_an_upward_import() -> None:
    tree = ast.parse(
        "from kvbus.routing.index import PrefixIndex\n"
        "def f():\n    from kvbus.ops import top\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kvbus.service import gateway\n"
    )
    assert violations("kvbus.bus.publisher", tree) == [
        "kvbus.bus.publisher:1 imports kvbus.routing.index",
        "kvbus.bus.publisher:3 imports kvbus.ops",
    ]
    assert violations("kvbus.service.gateway", ast.parse("import kvbus.ops.top")) == [
        "kvbus.service.gateway:1 imports kvbus.ops.top"
    ]
    assert violations("kvbus.newthing", ast.parse("")) == [
        "kvbus.newthing is in no layer (add it to LAYERS)"
    ]


def test_old_import_paths_are_the_moved_modules() -> None:
    """Code written against kvbus 0.2's flat modules goes on working (with a warning)."""
    import importlib
    import subprocess
    import sys
    import warnings

    import kvbus
    from kvbus._moved import MOVED

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for old, new in MOVED.items():
            assert importlib.import_module(old) is importlib.import_module(new), old
    assert callable(kvbus.subscribe)  # the function, never a module of that name
    warned = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", "from kvbus.index import X"],
        capture_output=True,
        text=True,
    )
    assert "kvbus.index moved to kvbus.routing.index" in warned.stderr


def test_every_module_is_on_its_folders_map() -> None:
    """Each subpackage's README.md lists its modules one line each (ARCHITECTURE.md)."""
    folders = [p for p in (ROOT / "kvbus").iterdir() if (p / "__init__.py").exists()]
    folders += [ROOT / "transports", ROOT / "connectors"]
    missing = []
    for folder in folders:
        text = (folder / "README.md").read_text()
        for path in sorted(folder.glob("*.py")) + sorted(folder.glob("*.c")):
            if path.name != "__init__.py" or folder.name == "metrics":
                if f"`{path.name}`" not in text:
                    missing.append(str(path.relative_to(ROOT)))
    assert missing == []
