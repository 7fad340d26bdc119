"""Find and judge, by reading the code, how a tree classifies rows with no
prior state (vLLM PR #51565).

Two kinds of site:

**Builders.** A class method ``build`` that calls the split function
(``split_decodes_and_prefills``) and fills a GDN-family metadata field. Its
verdict comes from the split call:

- no ``treat_short_extends_as_decodes=False``: rows are classified by query
  length alone, a new request's one-token first chunk is a decode and reads
  its recycled slot unmasked: ``affected``;
- ``treat_short_extends_as_decodes=False`` on metadata whose
  ``is_prefilling`` was replaced by a value compared against a prior-state
  field (``seq_lens_cpu_upper_bound <= query_lens``, ...): ``fixed``;
- the same on the runner's own ``is_prefilling`` (every prompt chunk a
  prefill, as vLLM's Mamba builders do): ``not_affected``;
- ``decode_threshold=0``: no decodes at all, ``not_affected``;
- anything else, or a family builder with no split call: ``unknown``.

A ``fixed`` or ``not_affected`` builder must also not count one-token rows
as decodes by length elsewhere in ``build`` (the spec branch of 0.10-0.17
did): such a count needs a later reset to 0 in the same block, else the
site is ``unknown``.

**Runners.** Where a step may replay a FULL decode CUDA graph for a batch
whose rows all have the decode length: V1's dispatch call of a real step
(``_determine_batch_execution_and_padding`` without ``force_uniform_decode``)
and V2's ``get_uniform_token_count``. The builder fills the graph's
persistent decode buffers only when it reports no prefill, so once it calls
a one-token row a prefill that replay runs on the previous step's buffers.
A runner is ``fixed`` when the route is closed to batches with a row that
has no computed tokens (our guard: ``force_uniform_decode=False if ...
num_computed_tokens_cpu ... == 0 ...``; for V2 a following ``if`` that sets
the count to None), ``affected`` when it is open and some builder of the
tree may call a one-token row a prefill (a half fix: 0.31.0-0.33.0 ship
it), else ``not_affected`` (the builder calls every one-token row a decode,
as the route assumes).

Nothing here is a version lookup: a fork with the same code gets the same
verdict, and one that differs gets ``unknown`` rather than a guess.
"""

from __future__ import annotations

import ast
import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass

from gdn_backport.site import Status

from .config import Config

PATCHSET = "pr51565"


@dataclass(frozen=True)
class Finding:
    """A site as the analysis of one module sees it."""

    kind: str  # "builder", "runner_v1" or "runner_v2"
    function: str  # Class.method
    line: int
    status: Status
    reason: str
    # builder: may call a one-token row a prefill; runner: the route is guarded.
    reclassifies: bool = False
    guarded: bool = False


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _calls(node: ast.AST, name: str) -> Iterator[ast.Call]:
    for n in ast.walk(node):
        if isinstance(n, ast.Call) and _name(n.func) == name:
            yield n


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _attrs(node: ast.AST) -> set[str]:
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)} | {
        n.id for n in ast.walk(node) if isinstance(n, ast.Name)
    }


def _methods(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef]]:
    for cls in tree.body:
        if isinstance(cls, ast.ClassDef):
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef):
                    yield f"{cls.name}.{fn.name}", fn


def _assignments(fn: ast.FunctionDef, name: str) -> list[ast.expr]:
    """The values assigned to the local ``name`` (``x = v``, ``x op= v``)."""
    return [value for _, value in _definitions(fn, name)]


def _params(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    return [p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]]


# -- builders ---------------------------------------------------------------------


def _replaced_is_prefilling(node: ast.expr, fn: ast.FunctionDef) -> ast.expr | bool | None:
    """What ``is_prefilling`` the split call's metadata argument carries:
    the expression it was replaced with, True for the metadata as the caller
    gave it, None when the analysis cannot tell."""
    if isinstance(node, ast.Call) and _name(node.func) == "replace":
        value = _keyword(node, "is_prefilling")
        return value if value is not None else True
    if isinstance(node, ast.Name):
        if node.id in _params(fn):
            return True
        values = _assignments(fn, node.id)
        if len(values) == 1:
            return _replaced_is_prefilling(values[0], fn)
    return None


@dataclass
class _Rule:
    """What the value handed as ``is_prefilling`` selects, as a conjunction."""

    prior: bool = False  # a conjunct selects rows without prior state
    gate: bool = False  # a conjunct is is_prefilling (capture dummies stay decodes)
    bad: str = ""  # why it is not a conjunction this analysis knows


def _field_read(node: ast.expr, fn: ast.FunctionDef, names: frozenset[str]) -> bool:
    """``node`` is a read of one of ``names`` (``m.f``, ``m.f[:n]``, or a
    local assigned once from such a read)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute):
        return node.attr in names
    if isinstance(node, ast.Name):
        values = _assignments(fn, node.id)
        return len(values) == 1 and _field_read(values[0], fn, names)
    return False


def _is_int(x: ast.expr, value: int) -> bool:
    """``x`` is the integer literal ``value`` (not ``False``/``True``)."""
    return isinstance(x, ast.Constant) and type(x.value) is int and x.value == value


def _compare_kind(node: ast.Compare, fn: ast.FunctionDef, cfg: Config) -> str:
    """``prior`` (selects rows without prior state), ``other`` (compares no
    prior-state field, e.g. ``query_lens > 0``) or ``wrong``."""
    if len(node.ops) != 1:
        return "wrong" if _attrs(node) & cfg.prior_state else "other"
    left, op, right = node.left, node.ops[0], node.comparators[0]
    const = _is_int
    if _field_read(left, fn, cfg.seq_lens):
        return "prior" if isinstance(op, ast.LtE | ast.Eq) else "wrong"
    if _field_read(right, fn, cfg.seq_lens):
        return "prior" if isinstance(op, ast.GtE | ast.Eq) else "wrong"
    if _field_read(left, fn, cfg.computed):
        ok = (isinstance(op, ast.Eq | ast.LtE) and const(right, 0)) or (
            isinstance(op, ast.Lt) and const(right, 1)
        )
        return "prior" if ok else "wrong"
    if _field_read(right, fn, cfg.computed):
        ok = (isinstance(op, ast.Eq | ast.GtE) and const(left, 0)) or (
            isinstance(op, ast.Gt) and const(left, 1)
        )
        return "prior" if ok else "wrong"
    return "other"


def _definitions(fn: ast.FunctionDef, name: str) -> list[tuple[str, ast.expr]]:
    """``("=", value)`` and ``("&=", value)`` (any other ``op=`` as its
    operator's name) of the local ``name``."""
    out: list[tuple[str, ast.expr]] = []
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in n.targets
        ):
            out.append(("=", n.value))
        elif (
            isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name) and n.target.id == name
        ):
            op = "&=" if isinstance(n.op, ast.BitAnd) else type(n.op).__name__
            out.append((op, n.value))
    return out


def _is_zeros(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and _name(node.func) in ("zeros_like", "zeros")


def _conjuncts(
    node: ast.expr, fn: ast.FunctionDef, cfg: Config, rule: _Rule, seen: frozenset[str]
) -> None:
    if rule.bad:
        return
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitAnd):
        _conjuncts(node.left, fn, cfg, rule, seen)
        _conjuncts(node.right, fn, cfg, rule, seen)
    elif isinstance(node, ast.Compare):
        kind = _compare_kind(node, fn, cfg)
        if kind == "wrong":
            rule.bad = f"{ast.unparse(node)} does not select rows without prior state"
        rule.prior |= kind == "prior"
    elif isinstance(node, ast.Attribute) and node.attr == "is_prefilling":
        rule.gate = True
    elif isinstance(node, ast.Name) and node.id not in seen and len(seen) < 4:
        defs = _definitions(fn, node.id)
        plain = [v for op, v in defs if op == "=" and not _is_zeros(v)]
        if not defs or len(plain) > 1 or any(op not in ("=", "&=") for op, _ in defs):
            rule.bad = f"{node.id} is not one conjunction of tests (assigned {len(defs)} ways)"
            return
        for op, value in defs:
            if not (op == "=" and _is_zeros(value)):  # the None branch: no row
                _conjuncts(value, fn, cfg, rule, seen | {node.id})
    else:
        rule.bad = f"{ast.unparse(node)} is not a test the analysis knows"


def _length_counts(fn: ast.FunctionDef, count: str) -> list[int]:
    """Lines where ``count`` (the decode count) is set from a ``== 1`` test
    of query lengths and no later statement of the same block sets it to 0
    under a condition: one-token rows counted as decodes by length alone."""
    bad: list[int] = []
    for block in ast.walk(fn):
        for field_name in ("body", "orelse"):
            stmts = getattr(block, field_name, None)
            if not isinstance(stmts, list):
                continue
            for i, stmt in enumerate(stmts):
                if not (
                    isinstance(stmt, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == count for t in stmt.targets)
                    and any(
                        isinstance(c, ast.Compare)
                        and any(isinstance(op, ast.Eq) for op in c.ops)
                        and any(
                            isinstance(x, ast.Constant) and x.value == 1
                            for x in [c.left, *c.comparators]
                        )
                        for c in ast.walk(stmt.value)
                    )
                ):
                    continue
                reset = any(
                    isinstance(later, ast.If)
                    and any(
                        isinstance(a, ast.Assign)
                        and any(isinstance(t, ast.Name) and t.id == count for t in a.targets)
                        and isinstance(a.value, ast.Constant)
                        and a.value.value == 0
                        for a in ast.walk(later)
                    )
                    for later in stmts[i + 1 :]
                )
                if not reset:
                    bad.append(stmt.lineno)
    return bad


def _split_target(fn: ast.FunctionDef, call: ast.Call) -> ast.Assign | None:
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign) and n.value is call:
            return n
    return None


def _judge_split(fn: ast.FunctionDef, call: ast.Call, cfg: Config) -> tuple[Status, str, bool]:
    threshold = _keyword(call, "decode_threshold")
    if threshold is None and len(call.args) > 1:
        threshold = call.args[1]
    if isinstance(threshold, ast.Constant) and threshold.value == 0:
        return Status.NOT_AFFECTED, "decode_threshold=0: every row is a prefill", True
    treat = _keyword(call, cfg.needs_param)
    if treat is None or (isinstance(treat, ast.Constant) and treat.value is True):
        return (
            Status.AFFECTED,
            f"{cfg.split} classifies by query length alone: a new request's one-token "
            "first chunk is a decode and reads its recycled state slot unmasked",
            False,
        )
    if not (isinstance(treat, ast.Constant) and treat.value is False):
        return Status.UNKNOWN, f"{cfg.needs_param} is not a constant", False
    if not call.args:
        return Status.UNKNOWN, f"{cfg.split} gets its metadata by keyword", False
    replaced = _replaced_is_prefilling(call.args[0], fn)
    if replaced is None:
        return (
            Status.UNKNOWN,
            f"cannot tell which is_prefilling the metadata handed to {cfg.split} carries",
            False,
        )
    if replaced is True:
        return (
            Status.NOT_AFFECTED,
            "every prompt chunk is a prefill (the runner's is_prefilling)",
            True,
        )
    assert isinstance(replaced, ast.expr)
    rule = _Rule()
    _conjuncts(replaced, fn, cfg, rule, frozenset())
    if rule.bad:
        return Status.UNKNOWN, f"is_prefilling is replaced: {rule.bad}", False
    if rule.prior and rule.gate:
        return (
            Status.FIXED,
            "rows without prior state are prefills (is_prefilling replaced by a "
            "prior-state test gated on is_prefilling)",
            True,
        )
    if rule.prior:
        return (
            Status.UNKNOWN,
            "the rule is not gated on is_prefilling: capture dummies (seq_len == "
            "query_len) become prefills, and the decode graph is captured without its "
            "buffers",
            False,
        )
    if rule.gate:
        return Status.NOT_AFFECTED, "every prompt chunk is a prefill (is_prefilling)", True
    return (
        Status.UNKNOWN,
        "is_prefilling is replaced by a value that compares no prior-state field",
        False,
    )


def _builder(qual: str, fn: ast.FunctionDef, cfg: Config, family: bool = False) -> Finding | None:
    """``family``: known to be a GDN builder whatever fields it names (a
    function put on ``GDN...MetadataBuilder`` as its ``build``)."""
    keywords = {k.arg for n in ast.walk(fn) if isinstance(n, ast.Call) for k in n.keywords}
    if not family and not (_attrs(fn) | keywords) & cfg.family:
        return None
    calls = list(_calls(fn, cfg.split))
    if not calls:
        return Finding(
            "builder",
            qual,
            fn.lineno,
            Status.UNKNOWN,
            f"fills GDN metadata without {cfg.split}: cannot tell how a new one-token "
            "row is classified",
        )
    worst: tuple[Status, str, bool, int] | None = None
    order = {Status.UNKNOWN: 0, Status.AFFECTED: 1, Status.FIXED: 2, Status.NOT_AFFECTED: 3}
    for call in calls:
        status, reason, reclassifies = _judge_split(fn, call, cfg)
        if status in (Status.FIXED, Status.NOT_AFFECTED):
            target = _split_target(fn, call)
            names = (
                target.targets[0].elts
                if target is not None and isinstance(target.targets[0], ast.Tuple)
                else []
            )
            count = names[0].id if names and isinstance(names[0], ast.Name) else "num_decodes"
            lines = _length_counts(fn, count)
            if lines:
                status = Status.UNKNOWN
                reason = (
                    f"line {lines[0]} counts one-token rows as decodes by length "
                    f"({count}) with no reset: a new one-token row there reads stale state"
                )
                reclassifies = False
        if worst is None or order[status] < order[worst[0]]:
            worst = (status, reason, reclassifies, call.lineno)
    assert worst is not None
    return Finding("builder", qual, worst[3], worst[0], worst[1], reclassifies=worst[2])


# -- runners ----------------------------------------------------------------------


def _v1_calls(qual: str, fn: ast.FunctionDef, cfg: Config) -> Iterator[Finding]:
    for call in _calls(fn, cfg.v1_dispatch):
        if not (isinstance(call.func, ast.Attribute) and _name(call.func.value) == "self"):
            continue
        force = _keyword(call, cfg.v1_force)
        if force is None:
            yield Finding(
                "runner_v1",
                qual,
                call.lineno,
                Status.AFFECTED,
                "FULL decode route open",
                guarded=False,
            )
        elif "num_computed_tokens" in " ".join(_attrs(force)):
            ok = (
                isinstance(force, ast.IfExp)
                and isinstance(force.body, ast.Constant)
                and force.body.value is False
                and isinstance(force.orelse, ast.Constant)
                and force.orelse.value is None
                and _any_without_computed(force.test)
            )
            yield Finding(
                "runner_v1",
                qual,
                call.lineno,
                Status.FIXED if ok else Status.UNKNOWN,
                "no FULL decode graph for a batch with a row that has no computed tokens"
                if ok
                else f"{cfg.v1_force}={ast.unparse(force)}: a guard the analysis cannot "
                "vouch for (expected: False when any row has no computed tokens, else None)",
                guarded=ok,
            )
        # Any other force_uniform_decode: capture and dummy runs, not a step.


def _v2_calls(qual: str, fn: ast.FunctionDef, cfg: Config) -> Iterator[Finding]:
    for block in ast.walk(fn):
        stmts = getattr(block, "body", None)
        if not isinstance(stmts, list):
            continue
        for i, stmt in enumerate(stmts):
            if not (
                isinstance(stmt, ast.Assign)
                and isinstance(stmt.value, ast.Call)
                and _name(stmt.value.func) == cfg.v2_shape_only
                and len(stmt.targets) == 1
                and isinstance(stmt.targets[0], ast.Name)
            ):
                continue
            target = stmt.targets[0].id
            guards = [
                later
                for later in stmts[i + 1 :]
                if isinstance(later, ast.If)
                and "num_computed_tokens" in " ".join(_attrs(later.test))
            ]
            guarded = any(
                _any_without_computed(later.test)
                and not later.orelse
                and any(
                    isinstance(a, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == target for t in a.targets)
                    and isinstance(a.value, ast.Constant)
                    and a.value.value is None
                    for a in later.body
                )
                for later in guards
            )
            status = Status.FIXED if guarded else Status.UNKNOWN if guards else Status.AFFECTED
            reason = {
                Status.FIXED: "no FULL decode graph for a batch with a row that has no "
                "computed tokens",
                Status.UNKNOWN: f"a guard of {target} the analysis cannot vouch for "
                "(expected: None when any request has no computed tokens)",
                Status.AFFECTED: "FULL decode route open",
            }[status]
            yield Finding("runner_v2", qual, stmt.lineno, status, reason, guarded=guarded)


def _zero_test(node: ast.AST) -> bool:
    """A comparison that holds for a count of computed tokens of 0 and only
    then: ``c == 0``, ``c <= 0``, ``c < 1`` (or mirrored), ``0 in counts``."""
    if not isinstance(node, ast.Compare) or len(node.ops) != 1:
        return False
    left, op, right = node.left, node.ops[0], node.comparators[0]
    const = _is_int
    if isinstance(op, ast.In):
        return const(left, 0)
    if const(right, 0):
        return isinstance(op, ast.Eq | ast.LtE)
    if const(right, 1):
        return isinstance(op, ast.Lt)
    if const(left, 0):
        return isinstance(op, ast.Eq | ast.GtE)
    if const(left, 1):
        return isinstance(op, ast.Gt)
    return False


def _any_without_computed(test: ast.expr) -> bool:
    """``test`` is true when some row has no computed tokens: an ``or``/``and``
    whose part is ``(counts == 0).any()``, ``np.any(counts == 0)``,
    ``any(r.num_computed_tokens == 0 for r in ...)`` or ``0 in counts``, with
    no negation on the way."""
    if isinstance(test, ast.BoolOp):
        parts = [_any_without_computed(v) for v in test.values]
        if isinstance(test.op, ast.Or):
            return any(parts)  # more batches off the route: never less safe
        # ``and``: besides the test, only ``count is not None`` may narrow it.
        others = [v for v, ok in zip(test.values, parts, strict=True) if not ok]
        return any(parts) and all(
            isinstance(v, ast.Compare)
            and isinstance(v.ops[0], ast.IsNot)
            and isinstance(v.comparators[0], ast.Constant)
            and v.comparators[0].value is None
            for v in others
        )
    if isinstance(test, ast.Call) and _name(test.func) == "bool" and len(test.args) == 1:
        return _any_without_computed(test.args[0])
    if isinstance(test, ast.Compare):
        return isinstance(test.ops[0], ast.In) and _zero_test(test)
    if isinstance(test, ast.Call) and _name(test.func) == "any":
        inner: list[ast.AST] = list(test.args)
        if isinstance(test.func, ast.Attribute):
            inner.append(test.func.value)
        for arg in inner:
            if isinstance(arg, ast.GeneratorExp):
                arg = arg.elt
            if _zero_test(arg) and "num_computed_tokens" in " ".join(_attrs(arg)):
                return True
    return False


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef]]:
    """Class methods (``Class.method``), then module functions (``name``)."""
    yield from _methods(tree)
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef):
            yield fn.name, fn


def _installed_builds(tree: ast.Module) -> dict[str, str]:
    """Module functions put on a class as its ``build`` (a plugin replacing
    ``GDNAttentionMetadataBuilder.build``, wrapped or not), anywhere in the
    module: function name -> the class expression it is put on (one
    function put on two classes: the last in ``ast.walk``'s order)."""
    found: list[tuple[tuple[int, tuple[int, ...]], str, str]] = []
    for path, node in _assign_statements(tree, ()):
        for target in node.targets:
            if isinstance(target, ast.Attribute) and target.attr == "build":
                value: ast.expr = node.value
                while isinstance(value, ast.Call):  # wraps(original)(fn), decorators
                    value = value.args[-1] if value.args else value.func
                if isinstance(value, ast.Name):
                    # ``ast.walk`` is breadth-first: by depth, then by path.
                    found.append(((len(path), path), value.id, ast.unparse(target.value)))
    found.sort(key=lambda item: item[0])
    return {name: on for _, name, on in found}


def _assign_statements(
    node: ast.AST, path: tuple[int, ...]
) -> Iterator[tuple[tuple[int, ...], ast.Assign]]:
    """Every ``=`` statement below ``node`` with its path (child indices, as
    ``ast.iter_child_nodes`` counts them). Statements live only in blocks:
    walking them, not every expression node, finds the same assignments as
    ``ast.walk`` at a fraction of its cost."""
    for i, child in enumerate(ast.iter_child_nodes(node)):
        if isinstance(child, ast.Assign):
            yield (*path, i), child
        elif isinstance(child, ast.stmt | ast.excepthandler | ast.match_case):
            yield from _assign_statements(child, (*path, i))


def _source_lines(text: str) -> list[str]:
    """The lines ast counts (split at ``\n``, ``\r\n``, ``\r``), each as
    Python reads its identifiers (NFKC: a non-ASCII letter may spell an
    ASCII name)."""
    lines = re.split(r"\r\n|\r|\n", text)
    if text.isascii():
        return lines
    return [unicodedata.normalize("NFKC", line) for line in lines]


def _names_in(lines: list[str], fn: ast.FunctionDef, name: str) -> bool:
    """``name`` is written in ``fn``'s lines (:func:`_source_lines`): a call
    of ``name`` inside needs it (a cheap test before walking every node)."""
    start = min([fn.lineno, *(d.lineno for d in fn.decorator_list)])
    end = fn.end_lineno or len(lines)
    return any(name in line for line in lines[start - 1 : end])


def analyse_module(tree: ast.Module, text: str, cfg: Config) -> list[Finding]:
    """The builders and runner routes of one module (runner verdicts are
    settled by :func:`settle`, which knows the tree's builders)."""
    out: list[Finding] = []
    v1 = cfg.v1_dispatch in text and any(fn.name == cfg.v1_uniform for _, fn in _methods(tree))
    v2 = cfg.v2_shape_only in text
    installed = _installed_builds(tree)
    # A class's own ``build`` where the module classifies with the split
    # function; any function a module installs as some class's ``build``.
    has_split = cfg.split in text
    lines = _source_lines(text) if v1 else None
    for qual, fn in _functions(tree):
        if (has_split and fn.name == "build" and "." in qual) or fn.name in installed:
            on = installed.get(fn.name, "") if "." not in qual else ""
            found = _builder(qual, fn, cfg, family="GDN" in on or "KDA" in on)
            if found is not None:
                out.append(found)
        if "." not in qual:
            continue
        if lines is not None and _names_in(lines, fn, cfg.v1_dispatch):
            out.extend(_v1_calls(qual, fn, cfg))
        if v2 and "scheduler_output" in _params(fn):
            out.extend(_v2_calls(qual, fn, cfg))
    return out


def settle(findings: list[Finding]) -> list[Finding]:
    """Runner verdicts from the tree's builders: an open FULL decode route is
    a bug where some builder may call a one-token row a prefill, and part of
    the fix where a builder is affected (its fix would make the route a half
    fix: the fix changes it, so it is reported affected, never "not affected
    and rewritten")."""
    reclassifies = any(f.kind == "builder" and f.reclassifies for f in findings)
    to_fix = any(f.kind == "builder" and f.status is Status.AFFECTED for f in findings)
    out = []
    for f in findings:
        if f.kind != "builder" and not f.guarded:
            if reclassifies:
                f = Finding(
                    f.kind,
                    f.function,
                    f.line,
                    Status.AFFECTED,
                    "a batch whose rows all have the decode length replays the FULL decode "
                    "graph on the previous step's buffers when the builder calls a row "
                    "without prior state a prefill (half fix)",
                )
            elif to_fix:
                f = Finding(
                    f.kind,
                    f.function,
                    f.line,
                    Status.AFFECTED,
                    "the FULL decode route replays the decode graph for any batch whose rows "
                    "all have the decode length; the builder's fix calls a new one-token row "
                    "a prefill, so this route must take the guard with it",
                )
            else:
                f = Finding(
                    f.kind,
                    f.function,
                    f.line,
                    Status.NOT_AFFECTED,
                    "the builder calls every one-token row a decode, as the FULL decode "
                    "route assumes",
                )
        out.append(f)
    return out
