"""The ``kernel`` strategy: call our op, which gathers the gate rows in-kernel."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path
from typing import Any, ClassVar, cast

import libcst as cst
from libcst.codemod.visitors import AddImportsVisitor

from gdn_backport import files
from gdn_backport.cst_nodes import code, index_select_parts, walk

from ..analysis import SpecCall
from ..codemods import examples as ex
from ..codemods.base import Plan, Planner, Refusal, SiteCodemod, live
from ..codemods.gather_gates import check_gate, gate_name
from ..provenance import Prov

MODULE = "gdn_backport_kernels"
OP = "gated_delta_rule_spec_update"
GUARD = "use_spec_update"
GATHER = "gather_token_rows"
SWAPPABLE = "fused_sigmoid_gating_delta_rule_update"
# The op's wrapper takes vLLM's arguments in vLLM's order, except this one.
UNSUPPORTED_ARGS = ("is_kda",)

_COMMA = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
# Calls an argument may make and still be evaluated twice (by the guard and
# by the branch it picks): views and copies of a tensor, nothing with effects.
_PURE_METHODS = frozenset(
    {"contiguous", "view", "view_as", "reshape", "flatten", "unflatten", "squeeze",
     "unsqueeze", "transpose", "permute", "narrow", "select", "expand", "to", "float", "clone",
     "half", "bfloat16", "int", "long", "size", "dim", "numel"}
)  # fmt: skip


def _impure_part(expr: cst.BaseExpression) -> cst.CSTNode | None:
    """The first call in ``expr`` that may do more than read (None: none)."""
    for node in walk(expr):
        if isinstance(node, cst.Call):
            func = node.func
            if not (isinstance(func, cst.Attribute) and func.attr.value in _PURE_METHODS):
                return node
        elif isinstance(node, (cst.Lambda, cst.NamedExpr, cst.Await, cst.Yield)):
            return node
    return None


def _extra_args(rows: str, slot: int) -> list[cst.Arg]:
    tight = cst.AssignEqual(
        whitespace_before=cst.SimpleWhitespace(""),
        whitespace_after=cst.SimpleWhitespace(""),
    )
    value: cst.BaseExpression = cst.Integer(str(abs(slot)))
    if slot < 0:
        value = cst.UnaryOperation(cst.Minus(), value)
    return [
        cst.Arg(cst.Name(rows), keyword=cst.Name("spec_token_indx"), equal=tight),
        cst.Arg(value, keyword=cst.Name("null_slot_id"), equal=tight),
    ]


def _with_args(args: list[cst.Arg], extra: list[cst.Arg]) -> list[cst.Arg]:
    """``args`` then ``extra``, laid out like the call's own arguments: the
    separator of the second-last argument (newline + indent in a multi-line
    call) between them, the last argument's own ending after them."""
    sep = args[-2].comma if len(args) >= 2 and isinstance(args[-2].comma, cst.Comma) else _COMMA
    ending = args[-1].comma if args else cst.MaybeSentinel.DEFAULT
    args = list(args)
    if args:
        args[-1] = args[-1].with_changes(comma=sep)
    extra = [e.with_changes(comma=sep) for e in extra[:-1]] + [extra[-1].with_changes(comma=ending)]
    return [*args, *extra]


class _Indent(cst.CSTTransformer):
    """Shift every continuation line of a node right by ``extra``."""

    def __init__(self, extra: str) -> None:
        self.extra = extra

    def leave_ParenthesizedWhitespace(
        self, original_node: cst.ParenthesizedWhitespace, updated_node: cst.ParenthesizedWhitespace
    ) -> cst.ParenthesizedWhitespace:
        line = updated_node.last_line.value + self.extra
        return updated_node.with_changes(last_line=cst.SimpleWhitespace(line))


def _line(indent: str) -> cst.ParenthesizedWhitespace:
    return cst.ParenthesizedWhitespace(indent=True, last_line=cst.SimpleWhitespace(indent))


def _closing_indent(call: cst.Call) -> str:
    """The indent of the line a multi-line call closes on ("" if one line)."""
    last = call.args[-1] if call.args else None
    if last is None:
        return ""
    ws = (
        last.comma.whitespace_after
        if isinstance(last.comma, cst.Comma)
        else last.whitespace_after_arg
    )
    return ws.last_line.value if isinstance(ws, cst.ParenthesizedWhitespace) else ""


def _guarded(op: cst.Call, guard: cst.Call, fallback: cst.Call) -> cst.IfExp:
    """``(op if guard else fallback)``, one branch a line, in parentheses:
    the call's own if it had them, else new ones around a shifted copy."""
    outer_lpar, outer_rpar = op.lpar, op.rpar
    base = _closing_indent(op)
    step = "" if outer_lpar else "    "
    if outer_lpar:
        head = outer_lpar[-1].whitespace_after
        inner = head.last_line.value if isinstance(head, cst.ParenthesizedWhitespace) else base
    else:
        inner = base + step
        outer_lpar = [cst.LeftParen(whitespace_after=_line(inner))]
        outer_rpar = [cst.RightParen(whitespace_before=_line(base))]
    branches = [
        cast(cst.Call, c.with_changes(lpar=[], rpar=[]).visit(_Indent(step)))
        for c in (op, guard, fallback)
    ]
    return cst.IfExp(
        test=branches[1],
        body=branches[0],
        orelse=branches[2],
        whitespace_before_if=_line(inner),
        whitespace_after_if=cst.SimpleWhitespace(" "),
        whitespace_before_else=_line(inner),
        whitespace_after_else=cst.SimpleWhitespace(" "),
        lpar=outer_lpar,
        rpar=outer_rpar,
    )


def _index_of(gather: cst.BaseExpression) -> cst.BaseExpression:
    """The index expression of an ``index_select`` gather (masks refused)."""
    parts = index_select_parts(gather) if isinstance(gather, cst.Call) else None
    if parts is not None and parts.index is not None:
        return parts.index
    raise Refusal(
        "the spec rows are selected by subscript (maybe a boolean mask); the op takes "
        "token indices: use --strategy gather"
    )


def null_slot_id(tree: Path) -> int:
    """The state-slot ids the tree's own spec kernel skips: ``<= returned``.

    Read from the kernel's source by analysis: vLLM skipped ``state_idx < 0``
    (PAD_SLOT_ID) up to 0.19 and ``state_idx <= 0`` (NULL_BLOCK_ID) after;
    the op must skip exactly what the kernel it replaces skipped.
    """
    marker = f"def {SWAPPABLE}(".encode()
    rules: dict[int, list[str]] = {}
    for path in files.python_files(tree):
        data = path.read_bytes()
        if marker not in data:
            continue
        for node in ast.walk(ast.parse(data, filename=str(path))):
            if not (isinstance(node, ast.Compare) and len(node.ops) == 1):
                continue
            left, op, right = node.left, node.ops[0], node.comparators[0]
            if not (
                isinstance(left, ast.Name)
                and "idx" in left.id
                and isinstance(right, ast.Constant)
                and right.value == 0
            ):
                continue
            # skip when idx < 0 / store when idx >= 0: -1 is the null slot;
            # skip when idx <= 0 / store when idx > 0: 0 is.
            kind = {ast.Lt: -1, ast.GtE: -1, ast.LtE: 0, ast.Gt: 0}.get(type(op))
            if kind is not None:
                rules.setdefault(kind, []).append(f"{path}:{node.lineno}")
    if len(rules) != 1:
        found = "; ".join(f"{k}: {v}" for k, v in rules.items()) or "no slot check found"
        raise Refusal(f"cannot tell which state slots the tree's {SWAPPABLE} skips ({found})")
    return next(iter(rules))


class KernelOpCodemod(SiteCodemod):
    """Swap each affected spec-kernel call for ``gdn_backport_kernels``' op.

    The op takes the ungathered gates plus the spec token index and gathers
    the gate rows inside the kernel. Next to each assignment that selects the
    spec rows of q/k/v, a fresh name takes the index that selection used
    (``spec_token_rows = spec_token_indx``) or ``None`` where q/k/v hold all
    rows (the pure-spec path, which stays zero-copy). The call becomes a
    guarded expression, so a call the op cannot serve never raises inside a
    model server::

        (op(<args>, spec_token_indx=rows, null_slot_id=n)
         if use_spec_update(<same args>)
         else <the tree's kernel>(<args, gates through gather_token_rows(_, rows)>))

    ``null_slot_id`` is the slot rule read from the tree's own kernel; the
    fallback branch is upstream's fix in the tree's own names, and the
    analysis proves both branches aligned in the rewritten file. Arguments
    are evaluated twice (guard, branch): a call with effects in one is
    refused. The import is added; the patched tree then needs
    ``gdn-backport`` (its ``gdn_backport_kernels``) installed.

    The slot rule lives in another file (the kernel's), which a file
    analysed alone (``python -m libcst.tool codemod``) does not show: there
    it is ``--null-slot-id N``, and without it the codemod refuses.
    """

    DESCRIPTION: str = "the spec call goes to gdn_backport_kernels' op"

    def __init__(self, *args: Any, null_slot_id: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Given by the caller, or read from the tree's kernel on first use.
        self.null_slot_id = null_slot_id

    @staticmethod
    def add_args(arg_parser: argparse.ArgumentParser) -> None:
        arg_parser.add_argument(
            "--null-slot-id",
            type=int,
            default=None,
            help=f"the state slot the tree's {SWAPPABLE} skips: -1 where it skips idx < 0, "
            "0 where it skips idx <= 0",
        )

    def plan_call(self, planner: Planner, call: SpecCall, plan: Plan) -> None:
        if call.kernel is None or call.kernel.name != SWAPPABLE:
            raise Refusal(f"only {SWAPPABLE} calls can be swapped for the op")
        if call.chain[-1].id != planner.frame.id:
            raise Refusal(
                f"the kernel is called in {call.chain[-1].qualname}, below the function that "
                "gathers the q/k/v rows; the op needs the spec token index there: use "
                "--strategy gather"
            )
        node = call.record.node
        if any(a.keyword is not None and a.keyword.value in UNSUPPORTED_ARGS for a in node.args):
            raise Refusal(f"the op has no {', '.join(UNSUPPORTED_ARGS)} argument")
        for gate in call.gates:
            if any(v.prov is Prov.SPEC for v in live(gate.vals, call.record.path)):
                raise Refusal("a gate is already gathered here: use --strategy gather")
            check_gate(planner, call, gate_name(gate.arg, gate.param), gate.vals)
        slot = self.null_slot_id
        if slot is None:
            if self.tree is None:
                raise Refusal(
                    "the kernel strategy needs the whole tree (to read its kernel's slot "
                    "rule), or --null-slot-id"
                )
            slot = self.null_slot_id = null_slot_id(self.tree)
        rows = planner.new_name("spec_token_rows")
        for sel in planner.selections(call):
            d = sel.definition
            if sel.kind == "gather":
                assert d.gather is not None
                planner.insert(plan, d, rows, _index_of(d.gather))
            else:
                planner.insert(plan, d, rows, cst.Name("None"))

        for arg in node.args:
            impure = _impure_part(arg.value)
            if impure is not None:
                raise Refusal(
                    f"argument {code(arg.value)} calls {code(impure)}: the guarded call "
                    "evaluates its arguments twice (guard and branch): use --strategy gather"
                )
        gate_slots = [node.args.index(g.arg) for g in call.gates]

        def swap(updated: cst.CSTNode) -> cst.CSTNode:
            assert isinstance(updated, cst.Call)
            op_args = _with_args(list(updated.args), _extra_args(rows, slot))
            fallback_args = list(updated.args)
            for i in gate_slots:
                gate = fallback_args[i]
                fallback_args[i] = gate.with_changes(
                    value=cst.Call(
                        cst.Name(GATHER),
                        [cst.Arg(gate.value, comma=_COMMA), cst.Arg(cst.Name(rows))],
                    )
                )
            return _guarded(
                updated.with_changes(func=cst.Name(OP), args=op_args),
                updated.with_changes(func=cst.Name(GUARD), args=op_args),
                updated.with_changes(args=fallback_args),
            )

        plan.edits[planner.ref(node)] = swap
        for name in (OP, GUARD, GATHER):
            AddImportsVisitor.add_needed_import(self.context, MODULE, name)

    # Examples (tests/test_codemods.py), run with the slot rule given.
    EXAMPLE_ARGS: ClassVar[dict[str, Any]] = {"null_slot_id": 0}
    REWRITES: ClassVar[tuple[tuple[str, str], ...]] = (
        (ex.UPSTREAM_SHAPE, ex.UPSTREAM_SHAPE_SWAPPED),
    )
    UNCHANGED: ClassVar[tuple[str, ...]] = (ex.UPSTREAM_SHAPE_SWAPPED, ex.UPSTREAM_SHAPE_FIXED)
    REFUSES: ClassVar[tuple[tuple[str, str], ...]] = (
        (ex.MASKED, "use --strategy gather"),
        (ex.ONE_GATE, "already gathered"),
        (ex.WRAPPED_KERNEL, "not a known kernel"),
        (ex.CALL_IN_ARGUMENT, "evaluates its arguments twice"),
    )
