"""What the package promises users in its metadata and README holds."""

from __future__ import annotations

import ast
import contextlib
import re
import shlex
import subprocess
import sys
import types
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from gdn_backport import verify
from tests.conftest import run

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _extra(name: str) -> dict[str, Requirement]:
    reqs = [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"][name]]
    return {r.name: r for r in reqs}


def test_the_kernels_extra_installs_only_a_triton_verify_accepts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """D10: ``pip install '.[kernels]'`` used to pick triton 3.9, which
    ``verify --device cpu`` then refused: the extra's range and
    ``triton_problem()``'s rule agree on every release around the bound."""
    spec: SpecifierSet = _extra("kernels")["triton"].specifier
    for version in ("3.0.0", "3.2.0", "3.6.0", "3.8.1", "3.9.0", "3.9.1", "3.10.0", "4.0.0"):
        monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__=version))
        accepted = verify.triton_problem() == ""
        assert accepted == (Version(version) in spec), f"triton {version}, extra {spec}"
    # One source of truth: the rule's bound is the extra's.
    bound = ".".join(map(str, verify.TRITON_TOO_NEW))
    assert f"<{bound}" in {str(s) for s in spec}


def _user_strings() -> list[tuple[str, str]]:
    """Every string literal of the package but docstrings: (file, text).
    Messages, help and output are made of these."""
    found = []
    for path in sorted(
        [*(REPO / "gdn_backport").rglob("*.py"), *(REPO / "patchsets").rglob("*.py")]
    ):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        rel = path.relative_to(REPO).as_posix()
        found += [
            (rel, node.value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docs
        ]
    return found


def _headings(doc: Path) -> list[str]:
    return [
        line.lstrip("#").strip() for line in doc.read_text().splitlines() if line.startswith("#")
    ]


def test_no_message_sends_users_to_notes() -> None:
    """D19: a refusal said "see NOTES", a file the package does not ship;
    messages point at the README or docs/ (a section that exists)."""
    strings = _user_strings()
    assert [(f, s) for f, s in strings if "NOTES" in s] == []
    text = " ".join(s for _, s in strings)
    cited = re.findall(r'(README|docs/[\w.-]+\.md)(?::|,) "([^"]+)"', text)
    assert ("docs/refusals.md", "Patchset pr51565") in cited
    for doc, section in cited:
        path = REPO / ("README.md" if doc == "README" else doc)
        assert any(h.startswith(section) for h in _headings(path)), (doc, section)


@pytest.mark.network
def test_the_pr51565_refusal_names_a_document_that_says_what_to_do(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """D19: the refusal of a release before 0.20.0 (no stateless rule for
    pr51565) names docs/refusals.md, whose pr51565 section says what to do."""
    code, _, err = run(capsys, "apply", "--patchset", "pr51565", "--release", "0.18.1", "--dry-run")
    assert code == 2 and err.count("\n") == 1
    assert "NOTES" not in err
    assert 'docs/refusals.md, "Patchset pr51565": move to a release with these fields' in err
    doc = (REPO / "docs" / "refusals.md").read_text()
    section = doc[doc.index("## Patchset pr51565") :]
    row = next(line for line in section.splitlines() if "no seq_lens_cpu_upper_bound" in line)
    assert "move to 0.20.0+ and apply" in row


def _readme_section(title: str) -> list[str]:
    """The command lines (indented blocks) of the README paragraph that
    starts with ``title``, up to the next heading."""
    text = (REPO / "README.md").read_text()
    assert title in text, f"the README has no {title!r}"
    start = text.index(title)
    end = text.find("\n#", start)
    block = text[start : end if end >= 0 else None]
    return [line.strip() for line in block.splitlines() if line.startswith("    ")]


def _closure(requirements: list[Requirement]) -> set[str]:
    """The distributions these requirements install, their own included
    (as this environment resolved them), canonical names."""
    seen: set[str] = set()
    extras: set[str] = set()
    todo = [r for r in requirements if r.marker is None or r.marker.evaluate()]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name == "gdn-backport":  # an extra of ours: its own requirements
            for extra in req.extras - extras:
                extras.add(extra)
                todo += _extra(extra).values()
            continue
        if name in seen:
            continue
        seen.add(name)
        with contextlib.suppress(metadata.PackageNotFoundError):
            for raw in metadata.requires(req.name) or []:
                dep = Requirement(raw)
                if dep.marker is None or dep.marker.evaluate({"extra": ""}):
                    todo.append(dep)
    return seen


def test_the_readme_runs_one_test_file_with_the_test_extra() -> None:
    """D20: the README's set-up venv had no pytest and no documented way to
    run one test file. Its "Run one test file" commands install the
    ``test`` extra, which brings every module the tests import, and the
    pytest line it gives runs."""
    lines = _readme_section("Run one test file")
    pip = [line for line in lines if " install " in line]
    assert pip == [".venv/bin/pip install -q -e '.[test]'"]
    core = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    wanted = _closure([Requirement("gdn-backport[test]"), *core])
    providers = metadata.packages_distributions()
    imported: set[str] = set()
    for path in (REPO / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    ours = {"tests", "gdn_backport", "gdn_backport_kernels", "tomli"}  # tomli: 3.10 only
    for module in sorted(imported - set(sys.stdlib_module_names) - ours):
        dists = {canonicalize_name(d) for d in providers.get(module, [])}
        assert dists & wanted, f"tests import {module}, which the test extra does not install"
    # The first pytest line, run as the README writes it (this venv's pytest).
    [first, *_] = [line for line in lines if line.startswith(".venv/bin/pytest ")]
    argv = shlex.split(first.split("#")[0])[1:]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *argv, "-q", "-p", "no:cacheprovider"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert " passed" in done.stdout
