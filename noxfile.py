"""nox sessions: tests, lint, and one session per matrix cell (matrix/releases.toml).

    nox -l                                  # every session, cells included
    nox -s "cell(0.25.1-gather)"            # one cell: fetch, patch a copy, scan, verify
    nox -t affected                         # the cells of every affected release
    nox -t <patchset id>                    # the cells of one patchset
    nox -s matrix                           # every cell in one process, summary table
    nox --no-venv -s matrix                 # the same with this interpreter's packages
    nox -s wheel                            # build sdist + wheel, twine check, use the wheel

A cell's id is ``<release>-<strategy>``; nox names the session ``cell(<id>)``
(the id replaces nox's default ``cell(release='0.25.1', strategy='gather')``).
Arguments after ``--`` go to ``gdn-backport matrix run``: ``--device cuda``,
``--scenario NAME``, ``--heads H,HV,D``, ``--results DIR`` (``--junit-dir``),
``--tree PATH``. See docs/ci.md.
"""

from __future__ import annotations

import itertools
import os
import shutil
import sys
from pathlib import Path

import nox

nox.options.sessions = ["tests", "lint", "wheel"]
nox.options.reuse_existing_virtualenvs = True

# The CPU build of torch lies on local disk here; a bare `torch` would pull a
# multi-GB CUDA build. Users bring their own torch: the package asks a range.
TORCH = os.environ.get("GDN_BACKPORT_TORCH", "torch==2.13.0")
# vLLM's FLA kernels, which the regression suite runs from each release, need
# block pointers (gone in triton 3.9); 3.6 is also what the GPU machines have.
TRITON = os.environ.get("GDN_BACKPORT_TRITON", "triton==3.6.0")

# The matrix and the strategies as data: matrix/releases.toml, and each
# patchset folder's patchset.toml and expected.toml. The noxfile must load
# without the package installed, so it reads the same files the same way
# (tests/test_noxfile.py holds its cells to gdn_backport.matrix's): a
# patchset expecting a release `affected` runs each of its strategies there,
# elsewhere its [matrix] `unaffected` cells. Tags: the patchset (`nox -t
# <id>`), the status (plain for the first patchset: `nox -t affected`;
# `<id>-<status>` for the others), the strategy.
ROOT = Path(__file__).resolve().parent
MATRIX = nox.project.load_toml(ROOT / "matrix" / "releases.toml")


def _patchsets() -> list[tuple[dict[str, object], dict[str, dict[str, object]]]]:
    """(patchset.toml, version -> expectation) of every patchset, in order."""
    found = []
    for folder in sorted((ROOT / "patchsets").iterdir()):
        if not (folder / "patchset.toml").is_file():
            continue
        info = nox.project.load_toml(folder / "patchset.toml")
        expected = folder / "expected.toml"
        rows = nox.project.load_toml(expected)["release"] if expected.is_file() else []
        found.append((info, {str(r["version"]): r for r in rows}))
    return sorted(found, key=lambda p: (p[0].get("order", 100), p[0]["id"]))


PATCHSETS = _patchsets()


def _cells() -> list[nox.param]:
    params = []
    for r in MATRIX["release"]:
        for rank, (info, expected) in enumerate(PATCHSETS):
            exp = expected.get(r["version"])
            if exp is None:
                continue
            status = exp["status"]
            affected = status == "affected"
            chosen = (
                info["strategies"] if affected else info.get("matrix", {}).get("unaffected", [])
            )
            for s in chosen:
                # wheel_only releases (0.15.x, ~500 MB wheels) run only when named.
                tags = (
                    ["wheel-only"]
                    if r.get("wheel_only")
                    else [
                        "cells",
                        "gpu",
                        info["id"],
                        status if rank == 0 else f"{info['id']}-{status}",
                        s,
                    ]
                )
                params.append(nox.param(r["version"], s, id=f"{r['version']}-{s}", tags=tags))
    defaults = [info["strategies"][0] for info, _ in PATCHSETS]
    for t in MATRIX.get("tree", []):
        for s in t.get("strategies", defaults):
            params.append(nox.param(t["name"], s, id=f"{t['name']}-{s}", tags=["tree", "gpu", s]))
    return params


# Prints the versions and whether torch sees a GPU (last line: cuda or cpu).
_PROBE = """
import importlib.metadata as m, platform, torch
def v(d):
    try:
        return m.version(d)
    except m.PackageNotFoundError:
        return "not installed"
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
print("python", platform.python_version(), "gdn-backport", v("gdn-backport"), "torch",
      v("torch"), "triton", v("triton"), "|", gpu)
print("cuda" if torch.cuda.is_available() else "cpu")
"""


def install(session: nox.Session, extra: str) -> None:
    if session.venv_backend == "none":
        # --no-venv / venv_backend="none": the interpreter's packages as they are.
        session.log("no virtualenv: using the packages of " + sys.executable)
        return
    session.install(TORCH, TRITON, "-e", f".[{extra}]")


def cells_impl(session: nox.Session, *select: str) -> None:
    """Shared by the cell sessions and `matrix`: install, versions, run the cells."""
    install(session, "test")
    python = sys.executable if session.venv_backend == "none" else "python"
    probe = session.run(python, "-c", _PROBE, silent=True)
    lines = str(probe).strip().splitlines()
    session.log(lines[0] if lines else "versions: unknown")
    args = list(session.posargs)
    if lines and lines[-1] != "cuda" and _wants_cuda(args):
        session.skip("--device cuda asked for, but torch sees no CUDA device")
    session.run(python, "-m", "gdn_backport", "matrix", "run", *select, *args)


def _wants_cuda(args: list[str]) -> bool:
    return "--device=cuda" in args or ("--device", "cuda") in itertools.pairwise(args)


@nox.session
def tests(session: nox.Session) -> None:
    """Unit, codemod, real-release and CPU-interpreter kernel tests."""
    install(session, "test")
    session.run(
        "python",
        "-c",
        "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)",
    )
    session.run(
        "pytest",
        # One worker per core, tests handed out as workers free up (the slow
        # ones are uneven); the ten slowest printed on every run. Arguments
        # after `--` come last and win (`-- -n 0 tests/test_cli.py`).
        "-n",
        "auto",
        "--dist",
        "worksteal",
        "--durations=10",
        *session.posargs,
        env={
            # Before anything imports triton: CPU runs of the real kernels.
            "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1"),
            # The kernels must run here: a Triton that cannot is a failure.
            "GDN_BACKPORT_REQUIRE_TRITON": "1",
        },
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (lint + format check) and strict mypy on the packages."""
    install(session, "dev")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", "gdn_backport", "kernels/gdn_backport_kernels", "patchsets")


@nox.session(default=False)
@nox.parametrize(("target", "strategy"), _cells())
def cell(session: nox.Session, target: str, strategy: str) -> None:
    """One matrix cell: fetch, patch a copy, scan, verify (GPU or CPU), JUnit XML."""
    cells_impl(session, "--cell", f"{target}-{strategy}")


@nox.session(default=False, tags=["gpu"])
def matrix(session: nox.Session) -> None:
    """Every cell in one process and environment; summary table, JSON and Markdown."""
    cells_impl(session)


@nox.session
def wheel(session: nox.Session) -> None:
    """Build the sdist and, from it, the wheel; `twine check` both; install the
    wheel into a fresh venv and use it there from outside the checkout."""
    # build and twine are release tools, needed by this session only.
    session.install("build", "twine")
    tmp = Path(session.create_tmp()).resolve()
    shutil.rmtree(tmp)
    dist = tmp / "dist"
    # Without --sdist/--wheel, build makes the wheel from the unpacked sdist:
    # a file the sdist forgets cannot reach the wheel either.
    session.run("python", "-m", "build", "--outdir", str(dist), str(ROOT))
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        session.error(f"expected one wheel and one sdist in {dist}, found {wheels + sdists}")
    session.run("twine", "check", "--strict", str(wheels[0]), str(sdists[0]))

    venv = tmp / "venv"
    session.run(sys.executable, "-m", "venv", str(venv), external=True)
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = str(bindir / "python")
    pip = [python, "-m", "pip", "install", "-q"]
    session.run(*pip, TORCH, TRITON, external=True)
    session.run(*pip, f"{wheels[0]}[kernels]", external=True)
    # Outside the checkout: nothing may be imported from the source tree.
    session.chdir(tmp)
    shutil.copy(ROOT / ".ci" / "installed_wheel.py", tmp)
    session.run(python, "installed_wheel.py", *(i["id"] for i, _ in PATCHSETS), external=True)
    cli = str(bindir / "gdn-backport")
    # 0.25.1 is affected: scan exits 1 and names the site; the matrix check
    # compares every scan of the release with matrix/releases.toml (exit 0).
    scan = [cli, "scan", "--release", "0.25.1"]
    # Wide enough that no table cell wraps (tables fit the terminal, 100
    # columns without one): the check below looks for whole names.
    out = session.run(*scan, external=True, success_codes=[1], silent=True, env={"COLUMNS": "1000"})
    if "affected" not in str(out) or "GDNAttentionMetadataBuilder.build" not in str(out):
        # Every patchset's sites: the layer's spec path and the metadata builder.
        session.error(f"gdn-backport scan --release 0.25.1 from the wheel: {out}")
    session.run(cli, "matrix", "check", "--release", "0.25.1", external=True)
