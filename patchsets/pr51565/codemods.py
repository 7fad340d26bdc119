"""The rewrites of patchset pr51565 (strategy ``reclassify``), with libcst.

**Builder** (upstream's placement, 0.31.0): before the split call of the
non-spec branch, ``no_prior_state = (query_lens > 0) &
(seq_lens_cpu_upper_bound <= query_lens)``, ANDed with ``is_prefilling``
and zeroed when that is None (capture batches, where seq_len == query_len
too, stay decodes); the call gets ``replace(m, is_prefilling=no_prior_state)``
and ``treat_short_extends_as_decodes=False``; after it trailing padding rows
(query length 0) come off both prefill counts. Everything is spelled in the
tree's own names: its metadata variable, its four counts.

**V1 runner**: the dispatch call of a real step gets
``force_uniform_decode=False if bool((self.input_batch.num_computed_tokens_cpu
[:num_reqs] == 0).any()) else None``: a batch holding a row with no computed
tokens never replays the FULL decode graph (the builder, which now calls
that row a prefill, does not fill the graph's decode buffers for it). The
rows the guard sees are a superset of the builder's (``seq_lens_cpu_upper_bound
= num_computed + query_len``), so the route is never taken with a prefill.

**V2 runner**: after ``count = get_uniform_token_count(...)``, ``count =
None`` when a scheduled request has no computed tokens (the scheduler
output's own counts, the same source as the runner's).

Each rewrite refuses (:class:`Refusal`) where the code is not the shape it
knows; the caller proves the result by analysing the tree again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor

from gdn_backport.cst_nodes import code
from gdn_backport.errors import Refusal

from .analysis import Finding
from .config import Config

DESCRIPTION = (
    "classify rows without prior state as prefills (builder) and keep them off the "
    "FULL decode CUDA-graph route (runner)"
)
_TAG = "gdn-backport: vllm-project/vllm#51565"


@dataclass(frozen=True)
class TreeFacts:
    """What the tree's metadata class and split function offer the rule."""

    fields: frozenset[str]  # CommonAttentionMetadata's fields
    split_params: frozenset[str]
    replace_method: bool  # CommonAttentionMetadata.replace(...) exists


def _call_name(node: cst.BaseExpression) -> str | None:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return node.attr.value
    return None


def _used_names(nodes: Sequence[cst.CSTNode]) -> set[str]:
    out: set[str] = set()
    for node in nodes:
        out.update(n.value for n in m.findall(node, m.Name()) if isinstance(n, cst.Name))
    return out


def _fresh(base: str, used: set[str]) -> str:
    name, i = base, 1
    while name in used:
        name, i = f"{base}_{i}", i + 1
    used.add(name)
    return name


class _Rewriter(cst.CSTTransformer):
    """Rewrites the named methods; ``done`` says which finding was applied."""

    def __init__(
        self, findings: Sequence[Finding], cfg: Config, facts: TreeFacts | None, source: str = ""
    ) -> None:
        self.source = source
        self.todo = {(f.function, f.kind): f for f in findings}
        self.cfg = cfg
        self.facts = facts
        self.done: set[tuple[str, str]] = set()
        self.cls: list[str] = []
        self.fn: list[cst.FunctionDef] = []
        self.need_replace = False
        self.need_torch = False

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.cls.append(node.name.value)

    def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        self.cls.pop()
        return updated

    def _qual(self, fn: cst.FunctionDef) -> str:
        return f"{self.cls[-1]}.{fn.name.value}" if self.cls else fn.name.value

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self.fn.append(node)
        # Only the methods to rewrite are walked (a runner module is 7,000 lines).
        return len(self.fn) == 1 and any(fn == self._qual(node) for fn, _ in self.todo)

    def leave_FunctionDef(
        self, original: cst.FunctionDef, updated: cst.FunctionDef
    ) -> cst.FunctionDef:
        self.fn.pop()
        return updated

    def _current(self, kind: str) -> Finding | None:
        if not self.fn or len(self.fn) > 1:
            return None  # methods only, not functions nested in them
        return self.todo.get((self._qual(self.fn[-1]), kind))

    # -- builder and V2: statements inserted around one statement ------------------

    def leave_IndentedBlock(
        self, original: cst.IndentedBlock, updated: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        builder = self._current("builder")
        v2 = self._current("runner_v2")
        if builder is None and v2 is None:
            return updated
        body: list[cst.BaseStatement] = []
        for i, stmt in enumerate(updated.body):
            others = [s for j, s in enumerate(updated.body) if j != i]
            if builder is not None and self._assigns_call(stmt, self.cfg.split):
                body.extend(self._builder(stmt, others, builder))
            elif v2 is not None and self._assigns_call(stmt, self.cfg.v2_shape_only):
                body.extend(self._v2(stmt, v2))
            else:
                body.append(stmt)
        return updated.with_changes(body=body)

    def _assign(self, stmt: cst.BaseStatement) -> cst.Assign | None:
        if (
            isinstance(stmt, cst.SimpleStatementLine)
            and len(stmt.body) == 1
            and isinstance(stmt.body[0], cst.Assign)
        ):
            return stmt.body[0]
        return None

    def _assigns_call(self, stmt: cst.BaseStatement, name: str) -> bool:
        a = self._assign(stmt)
        return a is not None and isinstance(a.value, cst.Call) and _call_name(a.value.func) == name

    def _builder(
        self, stmt: cst.BaseStatement, others: list[cst.BaseStatement], f: Finding
    ) -> list[cst.BaseStatement]:
        facts = self.facts
        where = f"{f.function} (line {f.line})"
        if facts is None:
            raise Refusal(
                f"{where}: no definition of CommonAttentionMetadata and {self.cfg.split} "
                "found in the tree; cannot tell which fields a rule may read"
            )
        missing = [n for n in self.cfg.needs_fields if n not in facts.fields]
        if self.cfg.needs_param not in facts.split_params:
            missing.append(f"{self.cfg.split}({self.cfg.needs_param}=...)")
        if missing:
            raise Refusal(
                f"{where}: this tree has no {', '.join(missing)}: no stateless rule tells a "
                "new one-token request from a capture dummy (both have seq_len == "
                "query_len) and keeps the split honest; not patched (docs/refusals.md, "
                '"Patchset pr51565": move to a release with these fields, 0.20.0 or later, '
                "and apply there)"
            )
        a = self._assign(stmt)
        assert a is not None and isinstance(a.value, cst.Call)
        call = a.value
        target = a.targets[0].target if len(a.targets) == 1 else None
        counts = (
            [e.value.value for e in target.elements if isinstance(e.value, cst.Name)]
            if isinstance(target, cst.Tuple)
            else []
        )
        if len(counts) != 4:
            raise Refusal(f"{where}: the split's result is not unpacked into four names")
        if not call.args or call.args[0].keyword is not None:
            raise Refusal(f"{where}: {self.cfg.split} gets no positional metadata")
        meta = call.args[0].value
        if not isinstance(meta, cst.Name):
            raise Refusal(f"{where}: {self.cfg.split} gets {code(meta)}, not a name")
        if any(arg.keyword is not None and arg.keyword.value == self.cfg.needs_param
               for arg in call.args):  # fmt: skip
            raise Refusal(f"{where}: {self.cfg.needs_param} is already passed")
        used = _used_names(others) | _used_names([stmt])
        ql = _fresh("query_lens_cpu", used)
        nps = _fresh("no_prior_state", used)
        mv = meta.value
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = counts
        if facts.replace_method:
            replaced = f"{mv}.replace(is_prefilling={nps})"
        else:
            replaced = f"replace({mv}, is_prefilling={nps})"
            self.need_replace = True
        self.need_torch = True
        lines = [
            f"# {_TAG}. Classify first chunks as prefills to mask\n"
            "# recycled state; resumed one-token chunks can still use the decode kernels.\n"
            f"assert {mv}.seq_lens_cpu_upper_bound is not None\n",
            f"{ql} = {mv}.query_start_loc_cpu.diff()\n",
            f"{nps} = ({ql} > 0) & ({mv}.seq_lens_cpu_upper_bound <= {ql})\n",
            "# Capture batches also have seq_len == query_len, but are not prefills.\n"
            f"if {mv}.is_prefilling is not None:\n"
            f"    {nps} &= {mv}.is_prefilling\n"
            "else:\n"
            f"    {nps} = torch.zeros_like({nps})\n",
        ]
        new_call = call.with_changes(
            args=[
                cst.Arg(cst.parse_expression(replaced)),
                *[arg.with_changes(comma=cst.MaybeSentinel.DEFAULT) for arg in call.args[1:]],
                cst.Arg(
                    cst.Name("False"),
                    keyword=cst.Name(self.cfg.needs_param),
                    equal=cst.AssignEqual(
                        whitespace_before=cst.SimpleWhitespace(""),
                        whitespace_after=cst.SimpleWhitespace(""),
                    ),
                ),
            ]
        )
        tail = (
            "# Exclude trailing padding from both prefill counts.\n"
            f"if {num_prefills}:\n"
            f"    {num_prefills} -= int(({ql}[{num_decodes}:] == 0).sum())\n"
            f"    {num_prefill_tokens} = (\n"
            f"        int({mv}.query_start_loc_cpu[{num_decodes} + {num_prefills}])\n"
            f"        - {num_decode_tokens}\n"
            "    )\n"
        )
        assert isinstance(stmt, cst.SimpleStatementLine)
        new_stmt = stmt.with_changes(body=[a.with_changes(value=new_call)])
        self.done.add((f.function, f.kind))
        return [
            *(cst.parse_statement(text) for text in lines),
            new_stmt,
            cst.parse_statement(tail),
        ]

    def _v2(self, stmt: cst.BaseStatement, f: Finding) -> list[cst.BaseStatement]:
        a = self._assign(stmt)
        assert a is not None
        where = f"{f.function} (line {f.line})"
        if len(a.targets) != 1 or not isinstance(a.targets[0].target, cst.Name):
            raise Refusal(f"{where}: the uniform token count is not assigned to one name")
        name = a.targets[0].target.value
        fn = self.fn[-1]
        params = {p.name.value for p in [*fn.params.params, *fn.params.kwonly_params]}
        if "scheduler_output" not in params:
            raise Refusal(f"{where}: no scheduler_output parameter to read computed tokens from")
        guard = cst.parse_statement(
            f"# {_TAG}: a request with no computed tokens is a\n"
            "# prefill for the GDN builder, which then fills no decode buffer: no FULL\n"
            "# decode graph for this batch.\n"
            f"if {name} is not None and (\n"
            "    any(r.num_computed_tokens == 0 for r in scheduler_output.scheduled_new_reqs)\n"
            "    or 0 in scheduler_output.scheduled_cached_reqs.num_computed_tokens\n"
            "):\n"
            f"    {name} = None\n"
        )
        self.done.add((f.function, f.kind))
        return [stmt, guard]

    # -- V1: one keyword added to the dispatch call -------------------------------

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        f = self._current("runner_v1")
        if f is None or not (
            isinstance(updated.func, cst.Attribute)
            and updated.func.attr.value == self.cfg.v1_dispatch
            and isinstance(updated.func.value, cst.Name)
            and updated.func.value.value == "self"
        ):
            return updated
        if any(
            a.keyword is not None and a.keyword.value == self.cfg.v1_force for a in updated.args
        ):
            return updated  # capture and dummy runs
        where = f"{f.function} (line {f.line})"
        computed = f"self.input_batch.{self.cfg.v1_computed}"
        if computed not in self.source:
            raise Refusal(
                f"{where}: the runner never reads {computed}; the guard would read a field "
                "this tree may not have"
            )
        reqs = next(
            (
                a.value
                for a in updated.args
                if a.keyword is not None and a.keyword.value == "num_reqs"
            ),
            updated.args[1].value
            if len(updated.args) > 1 and updated.args[1].keyword is None
            else None,
        )
        if not isinstance(reqs, cst.Name):
            raise Refusal(f"{where}: num_reqs is not passed as a plain name")
        guard = cst.parse_expression(
            f"False if bool((self.input_batch.{self.cfg.v1_computed}[:{reqs.value}] == 0).any()) "
            "else None"
        )
        args = list(updated.args)
        last = args[-1]
        # The new keyword takes the last argument's place in the layout: the
        # last one gets the separator the arguments before it have.
        between: cst.Comma | cst.MaybeSentinel = cst.Comma(
            whitespace_after=cst.SimpleWhitespace(" ")
        )
        if len(args) > 1 and isinstance(args[-2].comma, cst.Comma):
            between = args[-2].comma
        args[-1] = last.with_changes(comma=between)
        args.append(
            cst.Arg(
                guard,
                keyword=cst.Name(self.cfg.v1_force),
                equal=cst.AssignEqual(
                    whitespace_before=cst.SimpleWhitespace(""),
                    whitespace_after=cst.SimpleWhitespace(""),
                ),
                comma=last.comma,
            )
        )
        self.done.add((f.function, f.kind))
        return updated.with_changes(args=args)


def rewrite(text: str, findings: Sequence[Finding], cfg: Config, facts: TreeFacts | None) -> str:
    """``text`` with every finding of ``findings`` (its affected sites) fixed;
    Refusal where a site is not a shape this knows."""
    module = cst.parse_module(text)
    rewriter = _Rewriter(findings, cfg, facts, text)
    new = module.visit(rewriter)
    missed = sorted(set(rewriter.todo) - rewriter.done)
    if missed:
        name, kind = missed[0]
        what = {
            "builder": f"the {cfg.split} assignment",
            "runner_v1": f"the {cfg.v1_dispatch} call",
            "runner_v2": f"the {cfg.v2_shape_only} assignment",
        }[kind]
        raise Refusal(f"{name}: {what} is not a statement of the method's body this rewrite knows")
    context = CodemodContext()
    if rewriter.need_replace:
        if _binds_replace(module):
            raise Refusal("the module binds its own 'replace'; cannot import dataclasses.replace")
        AddImportsVisitor.add_needed_import(context, "dataclasses", "replace")
    if rewriter.need_torch:
        AddImportsVisitor.add_needed_import(context, "torch")
    if not (rewriter.need_replace or rewriter.need_torch):
        return new.code
    return AddImportsVisitor(context).transform_module(new).code


def _binds_replace(module: cst.Module) -> bool:
    """A module-level ``replace`` that is not dataclasses' (def, import, assignment)."""
    for node in module.body:
        if isinstance(node, cst.FunctionDef | cst.ClassDef) and node.name.value == "replace":
            return True
        if not isinstance(node, cst.SimpleStatementLine):
            continue
        for small in node.body:
            if isinstance(small, cst.Assign) and any(
                m.matches(t.target, m.Name("replace")) for t in small.targets
            ):
                return True
            if not isinstance(small, cst.ImportFrom) or isinstance(small.names, cst.ImportStar):
                continue
            if small.module is not None and code(small.module) == "dataclasses":
                continue
            for alias in small.names:
                bound = alias.asname.name if alias.asname is not None else alias.name
                if isinstance(bound, cst.Name) and bound.value == "replace":
                    return True
    return False
