"""The walls between the packages (ARCHITECTURE.md): the import-linter contracts in
pyproject.toml, checked on the real import graph, and the dashboard started without torch."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_are_kept():
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
         "sys.exit(lint_imports_command())", "--no-cache"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout


def test_the_dashboard_and_cli_load_without_importing_torch():
    code = ("import sys, gpuwatch.cli, gpuwatch.app, gpuwatch.sources.replay; "
            "print('torch' in sys.modules, 'gpuopt' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.stdout.split() == ["False", "False"], result.stderr
