"""Imports go one way (DESIGN.md): the engine never imports the web stack, schemas import
only pydantic.  Checked by parsing every module's import statements."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WEB = {"fastapi", "pydantic", "pydantic_settings", "redis", "uvicorn", "starlette",
       "prometheus_client", "httpx", "service", "schemas"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_engine_never_imports_web_stack():
    bad = {}
    for py in (ROOT / "engine").rglob("*.py"):
        hit = _imports(py) & WEB
        if hit:
            bad[str(py.relative_to(ROOT))] = sorted(hit)
    assert not bad, f"engine modules importing the web stack: {bad}"


def test_engine_reads_no_environment():
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "engine").rglob("*.py")
                 if "os.environ" in p.read_text() or "getenv(" in p.read_text()]
    assert not offenders, f"engine modules reading the environment: {offenders}"


def test_schemas_import_only_pydantic():
    allowed = {"pydantic", "typing", "typing_extensions", "__future__", "enum", "schemas",
               "annotated_types", "datetime", "base64", "re", "math"}
    bad = {}
    for py in (ROOT / "schemas").rglob("*.py"):
        hit = _imports(py) - allowed
        if hit:
            bad[str(py.relative_to(ROOT))] = sorted(hit)
    assert not bad, f"schemas modules importing outside pydantic: {bad}"
