"""The matrix's cells as CI documents, so a fork's CI spreads them over its GPU runners.

- GitHub Actions: ``{"include": [{"release", "strategy", "id"}, ...]}`` on one
  line, for ``strategy.matrix: ${{ fromJSON(...) }}``.
- Buildkite: a pipeline (YAML) with one command step per cell on an agent
  queue, for ``buildkite-agent pipeline upload``.

Each cell's job runs ``gdn-backport matrix run --cell <id>`` (see
:meth:`gdn_backport.matrix.Cell.selector`), which is what the nox session
``cell(<id>)`` runs too. The YAML writer below covers exactly the documents
made here (mappings, sequences, strings, integers, booleans); strings are
always double-quoted with JSON escapes, which YAML reads back unchanged.
:func:`check_github` and :func:`check_buildkite` hold what those systems
require; the CLI checks every document before printing it.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping, Sequence

from gdn_backport.errors import UsageError
from gdn_backport.matrix.model import Cell

__all__ = [
    "MAX_GITHUB_JOBS",
    "buildkite_pipeline",
    "buildkite_yaml",
    "check_buildkite",
    "check_github",
    "command",
    "github_json",
    "github_matrix",
    "step_key",
    "to_yaml",
]

# GitHub Actions runs at most 256 jobs per matrix.
MAX_GITHUB_JOBS = 256
RESULTS = ".nox-results"
# A GPU cell: fetch (cache), two verifies, a patch; generous for a cold Triton cache.
STEP_TIMEOUT_MINUTES = 30
_PLAIN_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_STEP_KEY = re.compile(r"^[A-Za-z0-9_:-]+$")
_UUID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
# The command step attributes Buildkite's pipeline schema allows (it rejects others).
BUILDKITE_STEP_KEYS = frozenset(
    (
        "agents", "allow_dependency_failure", "artifact_paths", "branches", "cache",
        "cancel_on_build_failing", "command", "commands", "concurrency", "concurrency_group",
        "concurrency_method", "depends_on", "env", "id", "identifier", "if", "key", "label",
        "matrix", "name", "notify", "parallelism", "plugins", "priority", "retry", "signature",
        "skip", "soft_fail", "timeout_in_minutes", "type",
    )
)  # fmt: skip


def command(cell: Cell) -> str:
    """The shell command that runs exactly ``cell``."""
    return shlex.join(["gdn-backport", "matrix", "run", *cell.selector()])


def github_matrix(cells: Sequence[Cell]) -> dict[str, list[dict[str, str]]]:
    include = []
    for c in cells:
        entry = {"id": c.id, "strategy": c.strategy}
        if c.release is not None:
            entry["release"] = c.release.version
        elif c.tree is not None:
            entry["tree"] = c.tree.path
            if c.tree.ref:
                entry["ref"] = c.tree.ref
        include.append(entry)
    doc = {"include": include}
    problems = check_github(doc)
    if problems:
        raise UsageError("github matrix: " + "; ".join(problems))
    return doc


def github_json(cells: Sequence[Cell]) -> str:
    """One line, for ``echo "matrix=$(...)" >> "$GITHUB_OUTPUT"``."""
    return json.dumps(github_matrix(cells), separators=(",", ":"))


def check_github(doc: object) -> list[str]:
    """Problems of a ``strategy.matrix`` document for ``fromJSON``; [] if none."""
    if not isinstance(doc, Mapping) or set(doc) != {"include"}:
        return ["must be an object with exactly the key 'include'"]
    include = doc["include"]
    if not isinstance(include, list) or not include:
        return ["'include' must be a non-empty list"]
    problems = []
    if len(include) > MAX_GITHUB_JOBS:
        problems.append(f"{len(include)} jobs: GitHub runs at most {MAX_GITHUB_JOBS} per matrix")
    ids = []
    for i, entry in enumerate(include):
        if not isinstance(entry, Mapping):
            problems.append(f"include[{i}]: must be an object")
            continue
        for key in ("id", "strategy"):
            if not isinstance(entry.get(key), str) or not entry[key]:
                problems.append(f"include[{i}]: '{key}' must be a non-empty string")
        if not ("release" in entry) ^ ("tree" in entry):
            problems.append(f"include[{i}]: needs exactly one of 'release' and 'tree'")
        if not all(isinstance(v, str) for v in entry.values()):
            problems.append(f"include[{i}]: values must be strings")
        ids.append(entry.get("id"))
    dup = sorted({str(i) for i in ids if ids.count(i) > 1})
    if dup:
        problems.append(f"ids not unique: {', '.join(dup)}")
    return problems


def step_key(cell: Cell) -> str:
    """A Buildkite step key: ``cell-0_25_1-gather`` (letters, digits, ``_:-``)."""
    return "cell-" + re.sub(r"[^A-Za-z0-9_:-]", "_", cell.id)


def buildkite_pipeline(
    cells: Sequence[Cell], queue: str = "gpu", setup: str = ""
) -> dict[str, object]:
    """One command step per cell on agent ``queue``; ``setup`` (a shell
    command, e.g. installing gdn-backport) runs before the cell if given.

    Buildkite interpolates ``$VAR`` in the pipeline when it is uploaded (from
    the upload step's environment, empty if unset); every ``$`` of the
    commands is written ``$$`` so the step's shell gets it as written
    (``$VAR`` is then the agent's variable, when the step runs)."""
    if not queue.strip():
        raise UsageError("--queue: must not be empty")
    before = f"{setup.strip()} && " if setup.strip() else ""
    steps = [
        {
            "label": _literal(f"gdn-backport {c.target} {c.strategy}"),
            "key": step_key(c),
            "command": _literal(before + command(c)),
            "agents": {"queue": queue},
            "artifact_paths": f"{RESULTS}/**/*",
            "timeout_in_minutes": STEP_TIMEOUT_MINUTES,
        }
        for c in cells
    ]
    doc: dict[str, object] = {"steps": steps}
    problems = check_buildkite(doc)
    if problems:
        raise UsageError("buildkite pipeline: " + "; ".join(problems))
    return doc


def _literal(text: str) -> str:
    """``text`` as Buildkite's upload-time interpolation gives it back."""
    return text.replace("$", "$$")


def buildkite_yaml(cells: Sequence[Cell], queue: str = "gpu", setup: str = "") -> str:
    head = "# gdn-backport matrix export buildkite: one step per matrix cell\n"
    return head + to_yaml(buildkite_pipeline(cells, queue, setup))


def check_buildkite(doc: object) -> list[str]:
    """Problems of a pipeline document of command steps; [] if none."""
    if not isinstance(doc, Mapping) or "steps" not in doc:
        return ["must be a mapping with 'steps'"]
    steps = doc["steps"]
    if not isinstance(steps, list) or not steps:
        return ["'steps' must be a non-empty list"]
    problems = []
    keys = []
    for i, step in enumerate(steps):
        at = f"steps[{i}]"
        if not isinstance(step, Mapping):
            problems.append(f"{at}: must be a mapping")
            continue
        unknown = sorted(set(step) - BUILDKITE_STEP_KEYS)
        if unknown:
            problems.append(f"{at}: attributes Buildkite does not know: {', '.join(unknown)}")
        for name in ("label", "command", "key"):
            if not isinstance(step.get(name), str) or not step[name].strip():
                problems.append(f"{at}: '{name}' must be a non-empty string")
        key = step.get("key")
        if isinstance(key, str) and (not _STEP_KEY.match(key) or _UUID.match(key)):
            problems.append(f"{at}: key {key!r}: letters, digits, '_:-' and not a UUID")
        keys.append(key)
        agents = step.get("agents")
        if agents is not None and not (
            isinstance(agents, Mapping) and all(isinstance(v, str) for v in agents.values())
        ):
            problems.append(f"{at}: 'agents' must map names to strings, e.g. {{queue: gpu}}")
        timeout = step.get("timeout_in_minutes")
        if timeout is not None and not (isinstance(timeout, int) and timeout >= 1):
            problems.append(f"{at}: 'timeout_in_minutes' must be an integer >= 1")
    dup = sorted({str(k) for k in keys if keys.count(k) > 1})
    if dup:
        problems.append(f"step keys not unique: {', '.join(dup)}")
    return problems


# -- a small YAML writer -----------------------------------------------------------


def _scalar(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a YAML double-quoted scalar
    raise TypeError(f"to_yaml: cannot write {type(value).__name__}")


def _key(key: object) -> str:
    if not isinstance(key, str):
        raise TypeError(f"to_yaml: mapping keys must be strings, not {type(key).__name__}")
    return key if _PLAIN_KEY.match(key) and key not in ("true", "false", "null") else _scalar(key)


def _lines(value: object, indent: int) -> list[str]:
    pad = " " * indent
    if isinstance(value, Mapping):
        if not value:
            return [pad + "{}"]
        out = []
        for k, v in value.items():
            if isinstance(v, (Mapping, list)) and v:
                out.append(f"{pad}{_key(k)}:")
                out += _lines(v, indent + 2)
            else:
                out.append(f"{pad}{_key(k)}: {_inline(v)}")
        return out
    if isinstance(value, list):
        if not value:
            return [pad + "[]"]
        out = []
        for item in value:
            sub = _lines(item, indent + 2)
            # "- " takes the place of the item's first indentation.
            out.append(f"{pad}- {sub[0].lstrip()}")
            out += sub[1:]
        return out
    return [pad + _scalar(value)]


def _inline(value: object) -> str:
    if isinstance(value, Mapping) and not value:
        return "{}"
    if isinstance(value, list) and not value:
        return "[]"
    return _scalar(value)


def to_yaml(doc: object) -> str:
    """Block-style YAML for mappings, lists, strings, ints and booleans."""
    return "\n".join(_lines(doc, 0)) + "\n"
