"""The mutation corpus's variants: fork-shaped edits of the real ``_forward_core``.

Forks carry vLLM's GDN layer with local edits: other local names, the kernel
called positionally or through an alias, comments and another formatter's
layout, extra statements and branches, the gather written another way, a
half-done or hand-made fix, a wrapper around the kernel, the spec path behind
helpers. Each :class:`Variant` is such an edit, written as a libcst
transformation of the *real* method of a release fetched from PyPI at run time
(no vLLM source lives in this repository), with the outcome it must have per
strategy:

* ``patched``: ``apply`` rewrites it; the result must scan as fixed, be
  idempotent, revert byte for byte, and pass the regression suite's mixed
  scenarios on the tree's own kernels (:func:`gdn_backport.verify.verify_tree`);
* ``fixed``: already correct; ``scan`` says ``fixed`` and ``apply`` changes
  nothing;
* ``refused``: ``apply`` exits 2 naming the file and the reason (a substring
  given here) and changes nothing on disk.

The releases edited are one per file layout of the affected releases, read
from ``matrix/releases.toml`` (:data:`LAYOUTS`). :mod:`tests.corpus.runner`
drives them.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import libcst as cst
from packaging.version import Version

from gdn_backport import matrix
from gdn_backport.cst_nodes import children_of, code, walk
from gdn_backport.patchsets.pr51812.config import load as load_patchset
from gdn_backport.site import Status

KERNEL = "fused_sigmoid_gating_delta_rule_update"
# The kernel's parameters in order (the same in every affected release).
KERNEL_PARAMS = ("A_log", "a", "b", "dt_bias", "q", "k", "v")
PATCHSET_ID = load_patchset().id
STRATEGIES = load_patchset().strategies


class CorpusError(Exception):
    """A variant's transformation found no place to apply (the corpus is wrong)."""


@dataclass(frozen=True)
class Layout:
    """Where one affected release keeps its GDN spec path."""

    version: str
    path: str  # the GDN module, relative to the tree root
    cls: str  # the class defining ``_forward_core``


def _layouts() -> tuple[Layout, ...]:
    """One release per file layout of the affected releases: the newest that
    keeps its GDN layer in that file (``matrix/releases.toml``)."""
    newest: dict[str, tuple[str, matrix.Expectation]] = {}
    for r in matrix.load().releases:
        e = r.expectation(PATCHSET_ID)
        if e is None or e.status is not Status.AFFECTED:
            continue
        if e.path not in newest or Version(r.version) > Version(newest[e.path][0]):
            newest[e.path] = (r.version, e)
    ordered = sorted(newest.values(), key=lambda item: Version(item[0]))
    return tuple(Layout(v, e.path, e.function.split(".")[0]) for v, e in ordered)


LAYOUTS = _layouts()


@dataclass(frozen=True)
class Expect:
    outcome: str  # "patched" | "fixed" | "refused"
    reason: str = ""  # for "refused": a substring of the one-line error

    def __str__(self) -> str:
        return f"{self.outcome} ({self.reason})" if self.reason else self.outcome


PATCHED = Expect("patched")
FIXED = Expect("fixed")


def refused(reason: str) -> Expect:
    return Expect("refused", reason)


# --- the method under edit ---------------------------------------------------


class Subject:
    """A module being edited, and helpers to find the parts of its GDN method."""

    def __init__(self, text: str, cls: str, layout: Layout | None = None) -> None:
        self.module = _parse(text)
        self.cls = cls
        self.layout = layout
        # Other files of the tree the variant adds: tree-relative path -> text.
        self.files: dict[str, str] = {}

    def method(self) -> cst.FunctionDef:
        for node in self.module.body:
            if isinstance(node, cst.ClassDef) and node.name.value == self.cls:
                for stmt in node.body.body:
                    if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "_forward_core":
                        return stmt
        raise CorpusError(f"class {self.cls} has no _forward_core")

    def replace(
        self, old: cst.CSTNode, new: cst.CSTNode | cst.FlattenSentinel[cst.CSTNode]
    ) -> None:
        """Put ``new`` (one node, or several in a sequence) where ``old`` is.

        Only ``old``'s ancestors are rebuilt; ``deep_replace`` rebuilds every
        node of the module."""
        chain = _ancestors(self.module, old)
        nodes = list(new.nodes) if isinstance(new, cst.FlattenSentinel) else [new]
        for parent in reversed(chain):
            nodes, old = [_with_child(parent, old, nodes)], parent
        self.module = cast(cst.Module, nodes[0])

    def insert_after(self, stmt: cst.CSTNode, text: str) -> None:
        self.replace(stmt, cst.FlattenSentinel([stmt, *_statements(text)]))

    def insert_before(self, stmt: cst.CSTNode, text: str) -> None:
        self.replace(stmt, cst.FlattenSentinel([*_statements(text), stmt]))

    def transform_method(self, transformer: cst.CSTTransformer) -> None:
        old = self.method()
        self.replace(old, cast(cst.FunctionDef, old.visit(transformer)))

    # -- anchors --------------------------------------------------------------

    def spec_call(self) -> cst.Call:
        """The spec-kernel call: fed the spec requests' state slots."""
        for node in walk(self.method()):
            if isinstance(node, cst.Call) and any(
                a.keyword is not None
                and a.keyword.value == "ssm_state_indices"
                and code(a.value) == "spec_state_indices_tensor"
                for a in node.args
            ):
                return node
        raise CorpusError("no spec-kernel call")

    def statement_of(self, node: cst.CSTNode) -> cst.SimpleStatementLine:
        """The statement line holding ``node``."""
        for stmt in walk(self.method()):
            if isinstance(stmt, cst.SimpleStatementLine) and any(n is node for n in walk(stmt)):
                return stmt
        raise CorpusError(f"no statement holds {code(node)[:60]!r}")

    def assignment(self, target: str, value_contains: str) -> cst.SimpleStatementLine:
        """The line ``target = <value containing the text>``."""
        for stmt in walk(self.method()):
            if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1):
                continue
            small = stmt.body[0]
            if (
                isinstance(small, cst.Assign)
                and code(small.targets[0].target) == target
                and value_contains in code(small.value)
            ):
                return stmt
        raise CorpusError(f"no assignment {target} = ...{value_contains}...")

    def gather(self) -> cst.SimpleStatementLine:
        """``mixed_qkv_spec = mixed_qkv.index_select(0, spec_token_indx)``."""
        return self.assignment("mixed_qkv_spec", "index_select(0, spec_token_indx)")

    def fast_path(self) -> cst.If:
        """``if <no prefills and no decodes>: mixed_qkv_spec = mixed_qkv ...``."""
        for node in walk(self.method()):
            if isinstance(node, cst.If) and any(
                isinstance(s, cst.SimpleStatementLine)
                and code(s).strip() == "mixed_qkv_spec = mixed_qkv"
                for s in node.body.body
            ):
                return node
        raise CorpusError("no pure-spec fast path")

    def body_start(self) -> cst.BaseStatement:
        """The first statement of the method after its docstring."""
        body = self.method().body
        assert isinstance(body, cst.IndentedBlock)
        first = body.body[0]
        if (
            isinstance(first, cst.SimpleStatementLine)
            and isinstance(first.body[0], cst.Expr)
            and isinstance(first.body[0].value, cst.SimpleString | cst.ConcatenatedString)
        ):
            return body.body[1]
        return first

    def set_call(self, call: cst.Call, new: cst.Call) -> None:
        self.replace(call, new)

    def cls_node(self) -> cst.ClassDef:
        for node in self.module.body:
            if isinstance(node, cst.ClassDef) and node.name.value == self.cls:
                return node
        raise CorpusError(f"no class {self.cls}")

    def add_method(self, text: str) -> None:
        """Append a method (written at class-body indentation) to the class."""
        cls = self.cls_node()
        body = cls.body
        assert isinstance(body, cst.IndentedBlock)
        method = cst.parse_module(textwrap.dedent(text)).body[0]
        method = method.with_changes(leading_lines=[cst.EmptyLine()])
        self.replace(cls, cls.with_changes(body=body.with_changes(body=[*body.body, method])))

    def add_function(self, text: str) -> None:
        """Put a module-level function right before the class."""
        cls = self.cls_node()
        [fn] = _statements(textwrap.dedent(text))
        fn = fn.with_changes(leading_lines=cls.leading_lines)
        blank = [cst.EmptyLine(), cst.EmptyLine()]
        self.replace(cls, cst.FlattenSentinel([fn, cls.with_changes(leading_lines=blank)]))

    def add_import(self, text: str) -> None:
        """A module-level import line after the kernel's own import."""
        imp, _ = _kernel_import(self.module)
        self.insert_after(_line_of(self.module, imp), text)

    def kernel_module(self) -> str:
        """The dotted module the release imports the spec kernel from."""
        imp, _ = _kernel_import(self.module)
        assert imp.module is not None
        return code(imp.module)


@functools.lru_cache(maxsize=4)
def _parse(text: str) -> cst.Module:
    # Nodes are immutable: every variant of a release starts from one parse.
    return cst.parse_module(text)


def _ancestors(root: cst.CSTNode, target: cst.CSTNode) -> list[cst.CSTNode]:
    """The nodes from ``root`` down to ``target``'s parent."""
    stack: list[tuple[cst.CSTNode, list[cst.CSTNode]]] = [(root, [])]
    while stack:
        node, path = stack.pop()
        for child in children_of(node):
            if child is target:
                return [*path, node]
            stack.append((child, [*path, node]))
    raise CorpusError("node not in the module")


def _with_child(parent: cst.CSTNode, old: cst.CSTNode, new: Sequence[cst.CSTNode]) -> cst.CSTNode:
    for f in dataclasses.fields(parent):
        value = getattr(parent, f.name)
        if value is old:
            [one] = new
            return parent.with_changes(**{f.name: one})
        if isinstance(value, (list, tuple)) and any(v is old for v in value):
            items: list[cst.CSTNode] = []
            for v in value:
                if v is old:
                    items.extend(new)
                else:
                    items.append(v)
            return parent.with_changes(**{f.name: items})
    raise CorpusError("child not found in its parent")


def _statements(text: str) -> list[cst.BaseStatement]:
    return list(cst.parse_module(text).body)


class _Rename(cst.CSTTransformer):
    """Rename names read or bound (not attributes, keywords or parameters)."""

    def __init__(self, mapping: dict[str, str]) -> None:
        self.mapping = mapping

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name) -> cst.Name:
        new = self.mapping.get(updated_node.value)
        return updated_node.with_changes(value=new) if new else updated_node

    def leave_Attribute(
        self, original_node: cst.Attribute, updated_node: cst.Attribute
    ) -> cst.Attribute:
        return updated_node.with_changes(attr=original_node.attr)

    def leave_Arg(self, original_node: cst.Arg, updated_node: cst.Arg) -> cst.Arg:
        return updated_node.with_changes(keyword=original_node.keyword)

    def leave_Param(self, original_node: cst.Param, updated_node: cst.Param) -> cst.Param:
        return updated_node.with_changes(name=original_node.name)

    def leave_ImportAlias(
        self, original_node: cst.ImportAlias, updated_node: cst.ImportAlias
    ) -> cst.ImportAlias:
        return updated_node.with_changes(name=original_node.name)


class _Collapse(cst.CSTTransformer):
    """Put a statement on one line: no newlines or comments inside brackets."""

    def leave_ParenthesizedWhitespace(
        self,
        original_node: cst.ParenthesizedWhitespace,
        updated_node: cst.ParenthesizedWhitespace,
    ) -> cst.SimpleWhitespace:
        return cst.SimpleWhitespace("")

    def leave_Comma(self, original_node: cst.Comma, updated_node: cst.Comma) -> cst.Comma:
        return updated_node.with_changes(
            whitespace_before=cst.SimpleWhitespace(""),
            whitespace_after=cst.SimpleWhitespace(" "),
        )


def _with_commas(args: Sequence[cst.Arg], like: Sequence[cst.Arg]) -> list[cst.Arg]:
    """``args`` reordered, each taking the separator of the slot it lands in."""
    return [a.with_changes(comma=slot.comma) for a, slot in zip(args, like, strict=True)]


def _arg(call: cst.Call, keyword: str) -> cst.Arg:
    for a in call.args:
        if a.keyword is not None and a.keyword.value == keyword:
            return a
    raise CorpusError(f"the call has no {keyword}= argument")


def _set_arg(call: cst.Call, keyword: str, value: str) -> cst.Call:
    old = _arg(call, keyword)
    args = [
        old.with_changes(value=cst.parse_expression(value)) if a is old else a for a in call.args
    ]
    return call.with_changes(args=args)


def _kernel_import(module: cst.Module) -> tuple[cst.ImportFrom, cst.ImportAlias]:
    for stmt in module.body:
        if isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.ImportFrom):
            imp = stmt.body[0]
            if isinstance(imp.names, cst.ImportStar):
                continue
            for alias in imp.names:
                if code(alias.name) == KERNEL:
                    return imp, alias
    raise CorpusError(f"no `from ... import {KERNEL}`")


def _line_of(module: cst.Module, node: cst.CSTNode) -> cst.SimpleStatementLine:
    for stmt in module.body:
        if isinstance(stmt, cst.SimpleStatementLine) and any(n is node for n in walk(stmt)):
            return stmt
    raise CorpusError("node not on a top-level line")


# --- the variants ----------------------------------------------------------------

Mutation = Callable[[Subject], None]


@dataclass(frozen=True)
class Variant:
    name: str
    doc: str
    mutate: Mutation
    gather: Expect
    kernel: Expect
    # Scenarios that do not apply to this variant, and why (verify runs the
    # others of those asked for, plus "production" so a mixed batch remains).
    skip: tuple[str, ...] = ()
    why_skip: str = ""

    def expect(self, strategy: str) -> Expect:
        return self.gather if strategy == "gather" else self.kernel

    def scenarios(self, asked: Sequence[str]) -> tuple[str, ...]:
        if not self.skip:
            return tuple(asked)
        kept = [s for s in asked if s not in self.skip]
        return tuple(dict.fromkeys([*kept, "production"]))


def _release(s: Subject) -> None:
    """The method as the release has it."""


def _rename_gates(s: Subject) -> None:
    s.transform_method(_Rename({"a": "alpha", "b": "beta_gate"}))
    s.insert_before(s.body_start(), "alpha, beta_gate = a, b\n")


def _rename_spec_locals(s: Subject) -> None:
    s.transform_method(
        _Rename(
            {
                "mixed_qkv_spec": "qkv_sd",
                "spec_token_indx": "sd_rows",
                "spec_state_indices_tensor": "sd_slots",
                "query_spec": "q_sd",
                "key_spec": "k_sd",
                "value_spec": "v_sd",
                "core_attn_out_spec": "out_sd",
            }
        )
    )


def _positional(s: Subject) -> None:
    call = s.spec_call()
    by_kw = {a.keyword.value: a for a in call.args if a.keyword is not None}
    front = [
        by_kw[p].with_changes(keyword=None, equal=cst.MaybeSentinel.DEFAULT) for p in KERNEL_PARAMS
    ]
    rest = [a for a in call.args if a.keyword is not None and a.keyword.value not in KERNEL_PARAMS]
    s.set_call(call, call.with_changes(args=_with_commas([*front, *rest], call.args)))


def _reordered_kwargs(s: Subject) -> None:
    call = s.spec_call()
    s.set_call(call, call.with_changes(args=_with_commas(list(reversed(call.args)), call.args)))


def _import_alias(s: Subject) -> None:
    imp, alias = _kernel_import(s.module)
    new_alias = alias.with_changes(asname=cst.AsName(cst.Name("gdn_spec_update")))
    s.replace(imp, imp.deep_replace(alias, new_alias))
    s.module = s.module.visit(_Rename({KERNEL: "gdn_spec_update"}))


def _module_alias(s: Subject) -> None:
    imp, _ = _kernel_import(s.module)
    module = code(imp.module) if imp.module is not None else ""
    parent, _, last = module.rpartition(".")
    s.insert_after(_line_of(s.module, imp), f"from {parent} import {last} as gdn_ops\n")
    call = s.spec_call()
    s.set_call(call, call.with_changes(func=cst.parse_expression(f"gdn_ops.{KERNEL}")))


def _local_alias(s: Subject) -> None:
    s.insert_before(s.body_start(), f"spec_update = {KERNEL}\n")
    call = s.spec_call()
    s.set_call(call, call.with_changes(func=cst.Name("spec_update")))


def _comments_in_call(s: Subject) -> None:
    call = s.spec_call()
    args = list(call.args)
    for i, a in enumerate(args):
        comma = a.comma
        if not (
            isinstance(comma, cst.Comma)
            and isinstance(comma.whitespace_after, cst.ParenthesizedWhitespace)
        ):
            raise CorpusError("the spec call is not one argument per line")
        ws = comma.whitespace_after
        if a.keyword is not None and a.keyword.value in ("a", "b"):
            first = ws.first_line.with_changes(
                whitespace=cst.SimpleWhitespace("  "),
                comment=cst.Comment(f"# fork: gate {a.keyword.value}, all token rows"),
            )
            ws = ws.with_changes(first_line=first)
        if a.keyword is not None and a.keyword.value == "dt_bias":
            note = cst.EmptyLine(
                indent=ws.indent,
                whitespace=ws.last_line,
                comment=cst.Comment("# q/k/v: the spec rows"),
            )
            ws = ws.with_changes(empty_lines=[*ws.empty_lines, note])
        args[i] = a.with_changes(comma=comma.with_changes(whitespace_after=ws))
    s.set_call(call, call.with_changes(args=args))
    gather = s.gather()
    s.replace(
        gather,
        gather.with_changes(
            leading_lines=[
                *gather.leading_lines,
                cst.EmptyLine(comment=cst.Comment("# fork: gather the spec rows")),
            ]
        ),
    )


def _collapsed_layout(s: Subject) -> None:
    stmt = s.statement_of(s.spec_call())
    s.replace(stmt, cast(cst.SimpleStatementLine, stmt.visit(_Collapse())))


def _aligned_layout(s: Subject) -> None:
    # yapf/pep8-style: arguments after the opening parenthesis, continuation
    # lines aligned with it. A text edit anchored on the collapsed call.
    _collapsed_layout(s)
    text = s.module.code
    start = text.index(f"{KERNEL}(A_log=")
    line_start = text.rindex("\n", 0, start) + 1
    column = start - line_start + len(KERNEL) + 1
    out, depth, i = [], 0, start + len(KERNEL)
    while True:
        ch = text[i]
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth == 1 and text.startswith(", ", i):
            out.append(",\n" + " " * column)
            i += 2
            continue
        out.append(ch)
        i += 1
        if depth == 0:
            break
    call = "".join(out).replace(",\n" + " " * column + ")", ")")
    s.module = cst.parse_module(text[: start + len(KERNEL)] + call + text[i:])


def _exploded_gather(s: Subject) -> None:
    # black's magic trailing comma: one argument per line.
    s.replace(
        s.gather(),
        _statements("mixed_qkv_spec = mixed_qkv.index_select(\n    0,\n    spec_token_indx,\n)\n")[
            0
        ],
    )


def _extra_statements(s: Subject) -> None:
    s.insert_after(s.gather(), "gathered_rows = mixed_qkv_spec.shape[0]\n")
    s.insert_after(
        s.fast_path(),
        "num_spec_rows = 0 if spec_token_indx is None else spec_token_indx.numel()\n"
        "if num_spec_rows < 0:\n"
        '    raise RuntimeError("negative spec row count")\n',
    )
    s.insert_before(
        s.statement_of(s.spec_call()),
        "assert query_spec.shape[1] == key_spec.shape[1]\ngate_rows = a.shape[0]\n",
    )


def _extra_branch(s: Subject) -> None:
    s.insert_after(
        s.fast_path(),
        'if getattr(self, "fork_contiguous_spec", True) and mixed_qkv_spec is not None:\n'
        "    mixed_qkv_spec = mixed_qkv_spec.contiguous()\n",
    )


def _duplicate_spec_call(s: Subject) -> None:
    stmt = s.statement_of(s.spec_call())
    text = code(stmt)
    indented = "".join("    " + line if line.strip() else line for line in text.splitlines(True))
    s.replace(
        stmt,
        _statements(
            'if getattr(self, "fork_alt_spec_kernel", False):\n' + indented + "else:\n" + indented
        )[0],
    )


def _no_fast_path(s: Subject) -> None:
    fast = s.fast_path()
    orelse = fast.orelse
    if not isinstance(orelse, cst.Else):
        raise CorpusError("the fast path has no else arm")
    assert isinstance(orelse.body, cst.IndentedBlock)
    s.replace(fast, cst.FlattenSentinel(list(orelse.body.body)))


def _fancy_index(s: Subject) -> None:
    s.replace(s.gather(), _statements("mixed_qkv_spec = mixed_qkv[spec_token_indx]\n")[0])


def _torch_index_select(s: Subject) -> None:
    s.replace(
        s.gather(),
        _statements("mixed_qkv_spec = torch.index_select(mixed_qkv, 0, spec_token_indx)\n")[0],
    )


def _hand_fix(s: Subject, fast: str, mixed: str, a: str, b: str) -> None:
    """Add lines to both arms of the fast path and pass ``a``/``b`` names."""
    s.insert_after(s.assignment("mixed_qkv_spec", "mixed_qkv"), fast)
    s.insert_after(s.gather(), mixed)
    call = s.spec_call()
    s.set_call(call, _set_arg(_set_arg(call, "a", a), "b", b))


def _one_gate(s: Subject) -> None:
    _hand_fix(s, "b_spec = b\n", "b_spec = b.index_select(0, spec_token_indx)\n", "a", "b_spec")


def _fixed_renamed(s: Subject) -> None:
    _hand_fix(
        s,
        "alpha_sd = a\nbeta_sd = b\n",
        "alpha_sd = a.index_select(0, spec_token_indx)\n"
        "beta_sd = torch.index_select(b, 0, spec_token_indx)\n",
        "alpha_sd",
        "beta_sd",
    )


def _fixed_fancy(s: Subject) -> None:
    _hand_fix(
        s,
        "a_rows = a\nb_rows = b\n",
        "a_rows = a[spec_token_indx]\nb_rows = b[spec_token_indx]\n",
        "a_rows",
        "b_rows",
    )


def _fixed_ifexp(s: Subject) -> None:
    test = code(s.fast_path().test)
    s.insert_before(
        s.statement_of(s.spec_call()),
        f"a_sd = a if {test} else a.index_select(0, spec_token_indx)\n"
        f"b_sd = b if {test} else b.index_select(0, spec_token_indx)\n",
    )
    call = s.spec_call()
    s.set_call(call, _set_arg(_set_arg(call, "a", "a_sd"), "b", "b_sd"))


def _gates_non_spec_index(s: Subject) -> None:
    _hand_fix(
        s,
        "a_spec = a\nb_spec = b\n",
        "a_spec = a.index_select(0, non_spec_token_indx)\n"
        "b_spec = b.index_select(0, non_spec_token_indx)\n",
        "a_spec",
        "b_spec",
    )


def _wrapper_function(s: Subject) -> None:
    [cls] = [n for n in s.module.body if isinstance(n, cst.ClassDef) and n.name.value == s.cls]
    [wrapper] = _statements(f"def _fork_spec_update(**kwargs):\n    return {KERNEL}(**kwargs)\n")
    blank = [cst.EmptyLine(), cst.EmptyLine()]
    wrapper = wrapper.with_changes(leading_lines=cls.leading_lines)
    s.replace(cls, cst.FlattenSentinel([wrapper, cls.with_changes(leading_lines=blank)]))
    call = s.spec_call()
    s.set_call(call, call.with_changes(func=cst.Name("_fork_spec_update")))


def _lambda_wrapper(s: Subject) -> None:
    s.insert_before(s.body_start(), f"spec_update = lambda **kw: {KERNEL}(**kw)\n")
    call = s.spec_call()
    s.set_call(call, call.with_changes(func=cst.Name("spec_update")))


def _starred_kwargs(s: Subject) -> None:
    s.insert_before(s.statement_of(s.spec_call()), "gate_kwargs = dict(a=a, b=b)\n")
    call = s.spec_call()
    args = [a for a in call.args if not (a.keyword and a.keyword.value in ("a", "b"))]
    star = cst.Arg(cst.Name("gate_kwargs"), star="**", comma=args[-1].comma)
    args[-1] = args[-1].with_changes(comma=args[-2].comma)
    s.set_call(call, call.with_changes(args=[*args, star]))


def _gate_reassigned(s: Subject) -> None:
    s.insert_before(s.statement_of(s.spec_call()), "a = a.contiguous()\n")


STAGED_GATES = """\
a_in = None
b_in = None
if not (a.is_contiguous() and b.is_contiguous()):
    a_in = a.contiguous()
    b_in = b.contiguous()
if a_in is None:
    a_in = a
if b_in is None:
    b_in = b
"""


def _staged_gates(s: Subject) -> None:
    call = s.spec_call()
    s.set_call(call, _set_arg(_set_arg(call, "a", "a_in"), "b", "b_in"))
    s.insert_before(s.statement_of(s.spec_call()), STAGED_GATES)


def _inline_gate_gather(s: Subject) -> None:
    call = s.spec_call()
    s.set_call(
        call,
        _set_arg(
            _set_arg(call, "a", "a.index_select(0, spec_token_indx)"),
            "b",
            "b.index_select(0, spec_token_indx)",
        ),
    )


def _ifexp_fast_path(s: Subject) -> None:
    fast = s.fast_path()
    test = code(fast.test)
    s.replace(
        fast,
        cst.FlattenSentinel(
            _statements(
                f"mixed_qkv_spec = mixed_qkv if {test} else "
                "mixed_qkv.index_select(0, spec_token_indx)\n"
                f"mixed_qkv_non_spec = None if {test} else "
                "mixed_qkv.index_select(0, non_spec_token_indx)\n"
            )
        ),
    )


def _untraceable_index(s: Subject) -> None:
    line = s.assignment("spec_token_indx", "attn_metadata.spec_token_indx")
    s.replace(line, _statements('spec_token_indx = getattr(attn_metadata, "spec_token_indx")\n')[0])


# --- the spec path through helpers (issue 12) ---------------------------------


def _spec_kwargs(s: Subject) -> list[str]:
    """The keyword names of the spec call, in order."""
    return [a.keyword.value for a in s.spec_call().args if a.keyword is not None]


def _call_via(s: Subject, func: str, extra: str = "") -> None:
    """Call ``func`` instead of the kernel, with the same keyword arguments
    (plus ``extra``, Python source of more arguments)."""
    call = s.spec_call()
    new = call.with_changes(func=cst.parse_expression(func))
    if extra:
        more = cst.parse_expression(f"f({extra})")
        assert isinstance(more, cst.Call)
        args = list(new.args)
        args[-1] = args[-1].with_changes(comma=args[-2].comma)
        last = more.args[-1].with_changes(comma=call.args[-1].comma)
        new = new.with_changes(args=[*args, *more.args[:-1], last])
    s.set_call(call, new)


def _forward_all(params: list[str], kernel: str = KERNEL) -> str:
    body = ", ".join(f"{p}={p}" for p in params)
    return f"{kernel}({body})"


def _helper_method(s: Subject) -> None:
    params = _spec_kwargs(s)
    s.add_method(
        f"def _fork_spec_update(self, {', '.join(params)}):\n"
        f"    # fork: one place to swap the spec kernel\n"
        f"    return {_forward_all(params)}\n"
    )
    _call_via(s, "self._fork_spec_update")


def _helper_positional(s: Subject) -> None:
    # The shape the issue quotes: gates first, q/k/v, slots, positionally.
    s.add_method(
        "def _spec_update(self, a, b, q, k, v, state, cu_seqlens, slots, accepted):\n"
        f"    return {KERNEL}(\n"
        "        A_log=self.A_log, a=a, b=b, dt_bias=self.dt_bias, q=q, k=k, v=v,\n"
        "        initial_state=state, inplace_final_state=True, cu_seqlens=cu_seqlens,\n"
        "        ssm_state_indices=slots, num_accepted_tokens=accepted,\n"
        "        use_qk_l2norm_in_kernel=True,\n"
        "    )\n"
    )
    call = s.spec_call()
    arg = {a.keyword.value: code(a.value) for a in call.args if a.keyword is not None}
    order = ("a", "b", "q", "k", "v", "initial_state", "cu_seqlens", "ssm_state_indices",
             "num_accepted_tokens")  # fmt: skip
    new = cst.parse_expression(f"self._spec_update({', '.join(arg[p] for p in order)})")
    s.set_call(call, cast(cst.Call, new))


def _helper_reads_metadata(s: Subject) -> None:
    # The helper reads the spec state slots from the metadata itself: the
    # caller never names them (before issue 12: "no GDN spec path found").
    s.add_method(
        "def _spec_recurrence(self, query, key, value, a, b, state, md):\n"
        "    slots = md.spec_state_indices_tensor\n"
        "    cu_seqlens = md.spec_query_start_loc[: md.num_spec_decodes + 1]\n"
        f"    return {KERNEL}(\n"
        "        A_log=self.A_log, a=a, b=b, dt_bias=self.dt_bias,\n"
        "        q=query, k=key, v=value, initial_state=state,\n"
        "        inplace_final_state=True, cu_seqlens=cu_seqlens,\n"
        "        ssm_state_indices=slots, num_accepted_tokens=md.num_accepted_tokens,\n"
        "        use_qk_l2norm_in_kernel=True,\n"
        "    )\n"
    )
    call = s.spec_call()
    new = cst.parse_expression(
        "self._spec_recurrence(query_spec, key_spec, value_spec, a, b, ssm_state, attn_metadata)"
    )
    s.set_call(call, cast(cst.Call, new))


def _module_function(s: Subject) -> None:
    params = [p for p in _spec_kwargs(s) if p not in ("A_log", "dt_bias")]
    body = ", ".join(["A_log=layer.A_log", "dt_bias=layer.dt_bias", *(f"{p}={p}" for p in params)])
    s.add_function(
        f"def _gdn_spec_update(layer, {', '.join(params)}):\n    return {KERNEL}({body})\n"
    )
    call = s.spec_call()
    drop = ("A_log", "dt_bias")
    args = [a for a in call.args if a.keyword is None or a.keyword.value not in drop]
    args[-1] = args[-1].with_changes(comma=call.args[-1].comma)
    layer = cst.Arg(cst.Name("self"), comma=call.args[0].comma)
    s.set_call(call, call.with_changes(func=cst.Name("_gdn_spec_update"), args=[layer, *args]))


def _two_levels(s: Subject) -> None:
    params = _spec_kwargs(s)
    s.add_function(
        f"def _gdn_spec_kernel({', '.join(params)}):\n    return {_forward_all(params)}\n"
    )
    s.add_method(
        f"def _spec_path(self, {', '.join(params)}):\n"
        f"    return _gdn_spec_kernel({', '.join(f'{p}={p}' for p in params)})\n"
    )
    _call_via(s, "self._spec_path")


def _two_callers(s: Subject) -> None:
    _helper_method(s)
    # A second caller (a fork's spec-only entry) that gathers q/k/v itself
    # and hands the helper raw gates too: both must be patched in one run.
    s.add_method(
        "def _fork_spec_only(self, mixed_qkv, b, a, attn_metadata):\n"
        "    spec_token_indx = attn_metadata.spec_token_indx\n"
        "    mixed_qkv_spec = mixed_qkv.index_select(0, spec_token_indx)\n"
        "    query_spec, key_spec, value_spec = self.rearrange_mixed_qkv(mixed_qkv_spec)\n"
        "    out, _ = self._fork_spec_update(\n"
        "        A_log=self.A_log, a=a, b=b, dt_bias=self.dt_bias,\n"
        "        q=query_spec, k=key_spec, v=value_spec,\n"
        "        initial_state=self.kv_cache[1], inplace_final_state=True,\n"
        "        cu_seqlens=attn_metadata.spec_query_start_loc,\n"
        "        ssm_state_indices=attn_metadata.spec_state_indices_tensor,\n"
        "        num_accepted_tokens=attn_metadata.num_accepted_tokens,\n"
        "        use_qk_l2norm_in_kernel=True,\n"
        "    )\n"
        "    return out\n"
    )


def _helper_fixed(s: Subject) -> None:
    # Fixed by hand in the caller; the helper receives gathered gates.
    _hand_fix(
        s,
        "a_sd = a\nb_sd = b\n",
        "a_sd = a.index_select(0, spec_token_indx)\nb_sd = b.index_select(0, spec_token_indx)\n",
        "a_sd",
        "b_sd",
    )
    _helper_method(s)


def _helper_forwards_badly(s: Subject) -> None:
    # The helper also reads the gate for something else: the caller's gate
    # cannot be swapped for a gathered one without changing that.
    params = _spec_kwargs(s)
    s.add_method(
        f"def _fork_spec_update(self, {', '.join(params)}):\n"
        "    self.fork_gate_rows = a.shape[0]\n"
        f"    return {_forward_all(params)}\n"
    )
    _call_via(s, "self._fork_spec_update")


def _imported_helper(s: Subject) -> None:
    # The helper lives in another module of the tree (a fork's ops file).
    params = _spec_kwargs(s)
    s.files["vllm/model_executor/layers/mamba/ops/fork_spec.py"] = (
        f'"""A fork\'s spec-decode entry point (written for the corpus)."""\n\n'
        f"from {s.kernel_module()} import {KERNEL}\n\n\n"
        f"def fork_spec_update({', '.join(params)}):\n"
        f"    return {_forward_all(params)}\n"
    )
    s.add_import("from vllm.model_executor.layers.mamba.ops.fork_spec import fork_spec_update\n")
    _call_via(s, "fork_spec_update")


def _fork_kernel(s: Subject) -> None:
    # A fork-only kernel: a name the tool cannot see into (here bound at
    # module level to the real kernel, so the suite can run it).
    imp, _ = _kernel_import(s.module)
    s.insert_after(_line_of(s.module, imp), f"fork_gdn_spec_kernel = {KERNEL}\n")
    _call_via(s, "fork_gdn_spec_kernel")


FORK_KERNEL_DECLARATION = (
    "# The fork declares its own kernel (written for the corpus).\n"
    "[[kernel]]\n"
    'name = "fork_gdn_spec_kernel"\n'
    'params = ["A_log", "a", "b", "dt_bias", "q", "k", "v", "initial_state",\n'
    '          "inplace_final_state", "cu_seqlens", "ssm_state_indices",\n'
    '          "num_accepted_tokens", "use_qk_l2norm_in_kernel"]\n'
    'rows = ["q", "k", "v"]\n'
    'gates = ["a", "b"]\n'
    'state_indices = "ssm_state_indices"\n'
    'accepted = "num_accepted_tokens"\n'
    "fix_target = true\n"
)


def _fork_kernel_declared(s: Subject) -> None:
    _fork_kernel(s)
    s.files[".gdn-backport.toml"] = FORK_KERNEL_DECLARATION


def _none_guard(s: Subject) -> None:
    # Gates staged through locals that start as None, set under a guard.
    s.insert_before(
        s.body_start(),
        "a_gate = None\nb_gate = None\n"
        "if a_gate is None:\n    a_gate = a\n"
        "if b_gate is None:\n    b_gate = b\n",
    )
    call = s.spec_call()
    s.set_call(call, _set_arg(_set_arg(call, "a", "a_gate"), "b", "b_gate"))


def _contradicting_branches(s: Subject) -> None:
    # A gate None on the branch that never meets the spec path.
    s.insert_after(
        s.assignment("spec_sequence_masks", "spec_sequence_masks"),
        "if spec_sequence_masks is None:\n    a_sd, b_sd = None, None\n"
        "else:\n    a_sd, b_sd = a, b\n",
    )
    call = s.spec_call()
    s.set_call(call, _set_arg(_set_arg(call, "a", "a_sd"), "b", "b_sd"))


def _contradicting_fixed(s: Subject) -> None:
    # Fixed by hand, the gates None where there is no spec path.
    test = code(s.fast_path().test)
    s.insert_before(
        s.statement_of(s.spec_call()),
        f"if spec_sequence_masks is None:\n    a_sd = b_sd = None\n"
        f"elif {test}:\n    a_sd, b_sd = a, b\n"
        "else:\n"
        "    a_sd = a.index_select(0, spec_token_indx)\n"
        "    b_sd = b.index_select(0, spec_token_indx)\n",
    )
    call = s.spec_call()
    s.set_call(call, _set_arg(_set_arg(call, "a", "a_sd"), "b", "b_sd"))


def _identity_index(s: Subject) -> None:
    # The fork builds the spec index itself when the metadata has none.
    s.insert_after(
        s.assignment("spec_token_indx", "attn_metadata.spec_token_indx"),
        "if spec_token_indx is None:\n"
        "    spec_token_indx = torch.arange(mixed_qkv.shape[0], device=mixed_qkv.device)\n",
    )


def _identity_index_always_gather(s: Subject) -> None:
    _identity_index(s)
    _no_fast_path(s)


UNKNOWN_WRAPPER = "not a known kernel"
CHAINED = "use --strategy gather"
VARIANTS: tuple[Variant, ...] = (
    Variant("release", "the method as released", _release, PATCHED, PATCHED),
    Variant(
        "rename_gates",
        "a, b read through other locals (alpha, beta_gate) everywhere",
        _rename_gates,
        PATCHED,
        PATCHED,
    ),
    Variant(
        "rename_spec_locals",
        "mixed_qkv_spec, spec_token_indx, spec_state_indices_tensor, q/k/v renamed",
        _rename_spec_locals,
        PATCHED,
        PATCHED,
    ),
    Variant(
        "positional_args",
        "the spec kernel called with A_log, a, b, dt_bias, q, k, v positional",
        _positional,
        PATCHED,
        PATCHED,
    ),
    Variant(
        "reordered_kwargs",
        "the spec kernel's keyword arguments in reverse order",
        _reordered_kwargs,
        PATCHED,
        PATCHED,
    ),
    Variant(
        "import_alias",
        "the kernel imported `as gdn_spec_update`",
        _import_alias,
        PATCHED,
        PATCHED,
    ),
    Variant(
        "module_alias",
        "the kernel called as an attribute of its ops module (`gdn_ops.kernel`)",
        _module_alias,
        PATCHED,
        PATCHED,
    ),
    Variant(
        "local_alias",
        "the kernel bound to a local (`spec_update = kernel`) and called through it",
        _local_alias,
        PATCHED,
        PATCHED,
    ),
    Variant(
        "comments_in_call",
        "comments inside the spec call and before the gather",
        _comments_in_call,
        PATCHED,
        PATCHED,
    ),
    Variant(
        "collapsed_layout",
        "the spec call collapsed onto one line (no black)",
        _collapsed_layout,
        PATCHED,
        PATCHED,
    ),
    Variant(
        "aligned_layout",
        "the spec call's arguments aligned under its opening parenthesis (yapf)",
        _aligned_layout,
        PATCHED,
        PATCHED,
    ),
    Variant(
        "exploded_gather",
        "the gather split one argument per line (black's magic trailing comma)",
        _exploded_gather,
        PATCHED,
        PATCHED,
    ),
    Variant(
        "extra_statements",
        "bookkeeping lines after the gather, after the fast path and before the call",
        _extra_statements,
        PATCHED,
        PATCHED,
    ),
    Variant(
        "extra_branch",
        "an extra branch re-assigning the spec rows (`.contiguous()`)",
        _extra_branch,
        PATCHED,
        PATCHED,
    ),
    Variant(
        "duplicate_spec_call",
        "the spec call duplicated in an if/else on a fork flag",
        _duplicate_spec_call,
        PATCHED,
        PATCHED,
    ),
    Variant(
        "no_fast_path",
        "the pure-spec fast path removed: always gather",
        _no_fast_path,
        PATCHED,
        PATCHED,
        skip=("pure_spec",),
        why_skip="without the fast path the fork copies q/k/v and gates in pure-spec "
        "batches too; pure_spec checks upstream's zero-copy aliasing",
    ),
    Variant(
        "fancy_index",
        "the spec rows gathered by subscript, `mixed_qkv[spec_token_indx]`",
        _fancy_index,
        PATCHED,
        refused("use --strategy gather"),
    ),
    Variant(
        "torch_index_select",
        "the spec rows gathered with `torch.index_select(mixed_qkv, 0, idx)`",
        _torch_index_select,
        PATCHED,
        PATCHED,
    ),
    Variant(
        "one_gate_gathered",
        "a half-done local fix: b gathered (and aliased in the fast path), a not",
        _one_gate,
        PATCHED,
        refused("already gathered"),
    ),
    Variant(
        "fixed_renamed",
        "fixed by hand under other names, index_select and torch.index_select",
        _fixed_renamed,
        FIXED,
        FIXED,
    ),
    Variant(
        "fixed_fancy",
        "fixed by hand with fancy indexing, `a[spec_token_indx]`",
        _fixed_fancy,
        FIXED,
        FIXED,
    ),
    Variant(
        "fixed_ifexp",
        "fixed by hand with conditional expressions on the fast path's own test",
        _fixed_ifexp,
        FIXED,
        FIXED,
    ),
    Variant(
        "gates_non_spec_index",
        "broken: gates gathered with the non-spec index",
        _gates_non_spec_index,
        refused("does not carry all token rows"),
        refused("does not carry all token rows"),
    ),
    Variant(
        "wrapper_function",
        "the kernel behind a module-level wrapper taking **kwargs",
        _wrapper_function,
        refused("*args/**kwargs"),
        refused("*args/**kwargs"),
    ),
    Variant(
        "lambda_wrapper",
        "the kernel behind a local lambda",
        _lambda_wrapper,
        refused(UNKNOWN_WRAPPER),
        refused(UNKNOWN_WRAPPER),
    ),
    Variant(
        "starred_kwargs",
        "the gates passed through **kwargs",
        _starred_kwargs,
        refused("*args/**kwargs"),
        refused("*args/**kwargs"),
    ),
    Variant(
        "gate_reassigned",
        "`a = a.contiguous()` between the gather and the call: gathered right before it",
        _gate_reassigned,
        PATCHED,
        refused("reassigned between the spec gather and the kernel call"),
    ),
    Variant(
        "staged_gates",
        "gates staged through locals that start as None and are set under a condition "
        "before the call: their rows chosen again right before it",
        _staged_gates,
        PATCHED,
        refused("reassigned between the spec gather and the kernel call"),
    ),
    Variant(
        "inline_gate_gather",
        "gates gathered inline in the call, also on the fast path (correct at run "
        "time, since the fast path's index is the identity, but not provable)",
        _inline_gate_gather,
        refused("right only if every row is a spec token"),
        refused("right only if every row is a spec token"),
    ),
    Variant(
        "ifexp_fast_path",
        "the fast path written as conditional expressions",
        _ifexp_fast_path,
        refused("does not prove aligned"),
        refused("does not prove aligned"),
    ),
    Variant(
        "untraceable_index",
        "the spec index read with getattr(md, 'spec_token_indx'): rows not traceable",
        _untraceable_index,
        refused("cannot be traced"),
        refused("cannot be traced"),
    ),
    Variant(
        "helper_method",
        "the spec kernel behind a method of the layer taking the call's keywords",
        _helper_method,
        PATCHED,
        refused(CHAINED),
    ),
    Variant(
        "helper_positional",
        "`self._spec_update(a, b, q, k, v, state, cu, slots, accepted)`, positional",
        _helper_positional,
        PATCHED,
        refused(CHAINED),
    ),
    Variant(
        "helper_reads_metadata",
        "a helper method reading the spec state slots from the metadata itself",
        _helper_reads_metadata,
        PATCHED,
        refused(CHAINED),
    ),
    Variant(
        "module_function",
        "the spec kernel behind a module-level function of the same file",
        _module_function,
        PATCHED,
        refused(CHAINED),
    ),
    Variant(
        "two_levels",
        "a method calling a module function calling the kernel",
        _two_levels,
        PATCHED,
        refused(CHAINED),
    ),
    Variant(
        "two_callers",
        "a helper method with a second caller passing raw gates: both patched",
        _two_callers,
        PATCHED,
        refused(CHAINED),
    ),
    Variant(
        "helper_fixed",
        "fixed by hand in the caller; the helper receives gathered gates",
        _helper_fixed,
        FIXED,
        FIXED,
    ),
    Variant(
        "helper_reads_gate",
        "the helper also reads its gate parameter: the gate cannot be swapped",
        _helper_forwards_badly,
        refused("beyond passing it to the kernel"),
        refused(CHAINED),
    ),
    Variant(
        "imported_helper",
        "the spec kernel behind a function of another module of the tree",
        _imported_helper,
        PATCHED,
        refused(CHAINED),
    ),
    Variant(
        "fork_kernel",
        "a fork-only kernel name the tool cannot see into, undeclared",
        _fork_kernel,
        refused("declare it"),
        refused("declare it"),
    ),
    Variant(
        "fork_kernel_declared",
        "the same fork kernel, declared in the tree's .gdn-backport.toml",
        _fork_kernel_declared,
        PATCHED,
        refused("can be swapped for the op"),
    ),
    Variant(
        "none_guard",
        "gates staged through locals that start as None, set under `is None` guards",
        _none_guard,
        PATCHED,
        PATCHED,
    ),
    Variant(
        "contradicting_branches",
        "gates None where spec_sequence_masks is None, raw in the spec branch",
        _contradicting_branches,
        PATCHED,
        PATCHED,
    ),
    Variant(
        "contradicting_fixed",
        "fixed by hand, the gates None where there is no spec path",
        _contradicting_fixed,
        FIXED,
        FIXED,
    ),
    Variant(
        "identity_index",
        "the spec index built with torch.arange when the metadata has none",
        _identity_index,
        PATCHED,
        PATCHED,
    ),
    Variant(
        "identity_index_always_gather",
        "a local torch.arange index and no fast path: always gathered",
        _identity_index_always_gather,
        PATCHED,
        PATCHED,
        skip=("pure_spec",),
        why_skip="without the fast path the fork copies q/k/v and gates in pure-spec "
        "batches too; pure_spec checks upstream's zero-copy aliasing",
    ),
)


def layout(version: str) -> Layout:
    for lay in LAYOUTS:
        if lay.version == version:
            return lay
    raise KeyError(f"{version}: no layout in the corpus")


def variant(name: str) -> Variant:
    for v in VARIANTS:
        if v.name == name:
            return v
    raise KeyError(f"{name}: no such variant")


def variant_source(original: str, lay: Layout, var: Variant) -> str:
    """The GDN module's text with ``var`` applied to its ``_forward_core``."""
    return variant_files(original, lay, var)[0]


def variant_files(original: str, lay: Layout, var: Variant) -> tuple[str, dict[str, str]]:
    """The GDN module's text with ``var`` applied, and the other files it
    adds to the tree (tree-relative path -> text)."""
    subject = Subject(original, lay.cls, lay)
    var.mutate(subject)
    text = subject.module.code
    if var.mutate is not _release and text == original:
        raise CorpusError(f"{var.name}: the transformation changed nothing")
    try:
        ast.parse(text)
    except SyntaxError as exc:
        raise CorpusError(f"{var.name}: the variant does not parse: {exc}") from exc
    return text, subject.files
