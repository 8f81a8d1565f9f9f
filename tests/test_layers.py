"""The walls between the packages (ARCHITECTURE.md): the import-linter contracts in
pyproject.toml, checked on the real import graph, no import cycle between modules, and the
dashboard started without torch."""

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("agent", "gpuwatch", "gpuopt")


def test_import_contracts_are_kept():
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
         "sys.exit(lint_imports_command())", "--no-cache"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 kept, 0 broken" in result.stdout


def test_the_wire_contracts_name_every_module_of_agent_outside_the_wire():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    outside = {_module_name(path) for path in (ROOT / "agent").iterdir()
               if path.name != "__init__.py" and path.name != "wire"
               and (path.suffix == ".py" or (path / "__init__.py").exists())}
    assert {"agent.step", "agent.integrations", "agent.search", "agent.io"} <= outside
    wire_contracts = [contract for contract in contracts["contracts"]
                      if contract["source_modules"] in (["agent.wire"], ["gpuwatch"])
                      and any(name.startswith("agent.") for name in
                              contract["forbidden_modules"])]
    assert len(wire_contracts) == 2
    for contract in wire_contracts:
        named = {name for name in contract["forbidden_modules"] if name.startswith("agent.")}
        assert named == outside, contract["name"]


def test_the_dashboard_and_cli_load_without_importing_torch():
    code = ("import sys, gpuwatch.cli, gpuwatch.app, gpuwatch.sources.replay; "
            "print('torch' in sys.modules, 'gpuopt' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.stdout.split() == ["False", "False"], result.stderr


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _module_imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The project's modules that ``path`` imports at its top level (under ``if`` and
    ``try`` too, ``if TYPE_CHECKING`` included: a cycle of types is a cycle of design),
    each as the longest module name the import names; imports inside functions are
    left out (they run later, by design)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    named: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                named.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                named.update(f"{base}.{alias.name}" for alias in node.names)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(node.orelse)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                visit(getattr(node, "finalbody", []))

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)).body)
    found = set()
    for module in named:
        while module and module not in modules:
            module = module.rpartition(".")[0]
        if module and module != name:
            found.add(module)
    return found


def _import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def strong(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in sorted(graph[module]):
            if imported not in index:
                strong(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = [stack.pop()]
            while component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            strong(module)
    return cycles


def test_the_cycle_finder_finds_a_cycle_and_only_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _import_cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycle_between_the_modules_of_the_three_packages():
    paths = {_module_name(path): path  # (an extension module by its stub, .pyi)
             for package in PACKAGES for suffix in ("*.py", "*.pyi")
             for path in (ROOT / package).rglob(suffix)}
    modules = set(paths)
    graph = {name: _module_imports(path, name, modules) for name, path in paths.items()}
    assert len(graph) > 90 and sum(map(len, graph.values())) > 300  # the graph was read
    assert graph["agent.step.core"] >= {"agent.io.ioloop", "agent.control.desk"}
    assert _import_cycles(graph) == []


def _private_fields(tree: ast.AST) -> set[str]:
    """The fields starting with one underscore that the classes of ``tree`` declare:
    methods, class attributes and what a method stores on ``self`` or ``cls``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for statement in node.body:
                if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef,
                                          ast.ClassDef)):
                    names.add(statement.name)
                elif isinstance(statement, (ast.Assign, ast.AnnAssign)):
                    targets = getattr(statement, "targets", [getattr(statement, "target",
                                                                     None)])
                    names.update(target.id for target in targets
                                 if isinstance(target, ast.Name))
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            names.add(node.attr)
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def _foreign_private_reads(sources: dict[str, str]) -> list[tuple[str, int, str]]:
    """Each ``x._name`` (``x`` not ``self`` or ``cls``) in one of ``sources`` (module name
    to source text) where ``_name`` is declared in another of them but not in its own:
    a part reading another part's private field, as (module, line, ``x._name``)."""
    trees = {name: ast.parse(text) for name, text in sources.items()}
    declared = {name: _private_fields(tree) for name, tree in trees.items()}
    everywhere = set().union(*declared.values())
    found = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in everywhere
                    and node.attr not in declared[name]
                    and not (isinstance(node.value, ast.Name)
                             and node.value.id in ("self", "cls"))):
                found.append((name, node.lineno, ast.unparse(node)))
    return sorted(found)


def test_the_private_field_finder_finds_a_read_from_another_module_only():
    sources = {"a": "class A:\n    def _save(self):\n        self._step = 1\n",
               "b": "def f(run):\n    run._save()\n    return run._step, self._save, x._other\n",
               "c": "class C:\n    _step = 0\ndef g(c):\n    return c._step\n"}
    assert _foreign_private_reads(sources) == [("b", 2, "run._save"), ("b", 3, "run._step")]


def test_no_module_reads_a_private_field_another_module_declares():
    sources = {_module_name(path): path.read_text(encoding="utf-8")
               for package in PACKAGES for path in (ROOT / package).rglob("*.py")}
    assert len(sources) > 90
    # A library's own private field whose name one of ours shares (Fabric's precision
    # plugin, read as Lightning's own connector does), not a part of this project's.
    found = {(module, read) for module, _, read in _foreign_private_reads(sources)}
    assert found == {("agent.integrations.fabric", "self.fabric._precision")}


#: The packages whose public docstrings all open with a one-line summary (PEP 257).
ONE_LINE_SUMMARIES = ("agent", "benchmarks", "examples", "gpuopt", "gpuwatch")


def _wrapped_summaries(path: Path) -> list[str]:
    """The public modules, classes and functions of ``path`` (not under a name starting
    with ``_``) whose docstring's first line runs on into the next: ``name:line`` each."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)):
            continue
        name = getattr(node, "name", "<module>")
        docstring = ast.get_docstring(node, clean=False)
        if name.startswith("_") or not docstring:
            continue
        lines = docstring.strip("\n").splitlines()
        if len(lines) > 1 and lines[1].strip():
            found.append(f"{name}:{getattr(node, 'lineno', 1)}")
    return found


def test_the_summary_finder_finds_a_wrapped_first_line_only(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text('"""One line.\n\nMore."""\n\n\ndef f():\n    """Runs on\n    here."""\n\n\n'
                      'def _g():\n    """Runs on\n    here."""\n\n\nclass C:\n    """One."""\n')
    assert _wrapped_summaries(source) == ["f:6"]


def test_public_docstrings_open_with_a_one_line_summary():
    paths = [path for package in ONE_LINE_SUMMARIES for path in (ROOT / package).rglob("*.py")]
    assert len(paths) >= 5
    assert [f"{path.relative_to(ROOT)}:{where}" for path in paths
            for where in _wrapped_summaries(path)] == []
