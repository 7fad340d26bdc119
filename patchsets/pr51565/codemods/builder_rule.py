"""The builder rule: rows without prior state are prefills (upstream's 0.31.0 rule)."""

from __future__ import annotations

import ast
from typing import ClassVar

import libcst as cst
import libcst.matchers as m
from libcst.codemod.visitors import AddImportsVisitor

from gdn_backport.cst_nodes import code
from gdn_backport.errors import Refusal

from ..analysis import Finding
from . import examples as ex
from .base import TAG, FindingCodemod, assignment, assigns_call, fresh, tight_equal, used_names


class BuilderRuleCodemod(FindingCodemod):
    """Classify a row without prior state as a prefill in a GDN metadata builder.

    Before the split call of the non-spec branch (upstream's placement),
    ``no_prior_state = (query_lens > 0) & (seq_lens_cpu_upper_bound <=
    query_lens)``, ANDed with ``is_prefilling`` and zeroed when that is None
    (capture batches, where seq_len == query_len too, stay decodes); the
    call gets ``replace(m, is_prefilling=no_prior_state)`` (the metadata's
    own ``replace`` method where it has one) and
    ``treat_short_extends_as_decodes=False``; after it, trailing padding
    rows (query length 0) come off both prefill counts. Everything is
    spelled in the tree's own names: its metadata variable, its four counts.

    The rule reads fields only some trees have: the tree's
    ``CommonAttentionMetadata`` and split function must offer them, or the
    codemod refuses. Alone (``python -m libcst.tool codemod``), those are
    the definitions in the file itself; a builder's file as vLLM ships it
    holds neither, and is refused with that reason.
    """

    KIND = "builder"
    IMPORTS = True
    DESCRIPTION: str = "rows without prior state classified as prefills (the builder)"

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        # Set where the metadata has no replace method: dataclasses' is imported.
        self.need_replace = False
        return super().transform_module_impl(tree)

    def missing(self) -> str:
        return f"the {self.cfg.split} assignment"

    def leave_IndentedBlock(
        self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        site = self.site()
        if site is None:
            return updated_node
        body: list[cst.BaseStatement] = []
        for i, stmt in enumerate(updated_node.body):
            if assigns_call(stmt, self.cfg.split):
                others = [s for j, s in enumerate(updated_node.body) if j != i]
                body.extend(self._rule(stmt, others, site))
            else:
                body.append(stmt)
        return updated_node.with_changes(body=body)

    def _check_facts(self, site: Finding) -> None:
        cfg, facts, where = self.cfg, self.facts, self.where(site)
        if facts is None:
            raise Refusal(
                f"{where}: no definition of CommonAttentionMetadata and {cfg.split} "
                f"found in {self.scope}; cannot tell which fields a rule may read"
            )
        missing = [n for n in cfg.needs_fields if n not in facts.fields]
        if cfg.needs_param not in facts.split_params:
            missing.append(f"{cfg.split}({cfg.needs_param}=...)")
        if missing:
            raise Refusal(
                f"{where}: this tree has no {', '.join(missing)}: no stateless rule tells a "
                "new one-token request from a capture dummy (both have seq_len == "
                "query_len) and keeps the split honest; not patched (docs/refusals.md, "
                '"Patchset pr51565": move to a release with these fields, 0.20.0 or later, '
                "and apply there)"
            )

    def _rule(
        self, stmt: cst.BaseStatement, others: list[cst.BaseStatement], site: Finding
    ) -> list[cst.BaseStatement]:
        self._check_facts(site)
        assert self.facts is not None
        cfg, where = self.cfg, self.where(site)
        a = assignment(stmt)
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
            raise Refusal(f"{where}: {cfg.split} gets no positional metadata")
        meta = call.args[0].value
        if not isinstance(meta, cst.Name):
            raise Refusal(f"{where}: {cfg.split} gets {code(meta)}, not a name")
        if any(arg.keyword is not None and arg.keyword.value == cfg.needs_param
               for arg in call.args):  # fmt: skip
            raise Refusal(f"{where}: {cfg.needs_param} is already passed")
        used = used_names(others) | used_names([stmt])
        ql = fresh("query_lens_cpu", used)
        nps = fresh("no_prior_state", used)
        mv = meta.value
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = counts
        if self.facts.replace_method:
            replaced = f"{mv}.replace(is_prefilling={nps})"
        else:
            replaced = f"replace({mv}, is_prefilling={nps})"
            self.need_replace = True
        lines = [
            f"# {TAG}. Classify first chunks as prefills to mask\n"
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
                cst.Arg(cst.Name("False"), keyword=cst.Name(cfg.needs_param), equal=tight_equal()),
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
        self.fixed(site)
        return [
            *(cst.parse_statement(text) for text in lines),
            new_stmt,
            cst.parse_statement(tail),
        ]

    def after_visit(self, tree: cst.Module) -> None:
        if self.need_replace:
            whole = self.within.module if self.within is not None else None
            if _binds_replace(tree) if whole is None else _binds_replace_ast(whole):
                raise Refusal(
                    "the module binds its own 'replace'; cannot import dataclasses.replace"
                )
            AddImportsVisitor.add_needed_import(self.context, "dataclasses", "replace")
        AddImportsVisitor.add_needed_import(self.context, "torch")

    # Examples, run by tests/test_codemods.py and the libcst tool's test.
    REWRITES: ClassVar[tuple[tuple[str, str], ...]] = (
        (ex.BUILDER, ex.BUILDER_FIXED),
        (ex.BUILDER_REPLACE_METHOD, ex.BUILDER_REPLACE_METHOD_FIXED),
    )
    UNCHANGED: ClassVar[tuple[str, ...]] = (
        ex.BUILDER_FIXED,
        ex.BUILDER_EVERY_CHUNK_A_PREFILL,
        ex.BUILDER_NO_DECODES,
        ex.BUILDER_OTHER_FAMILY,
    )
    REFUSES: ClassVar[tuple[tuple[str, str], ...]] = (
        (ex.BUILDER_OLD_FIELDS, "no stateless rule tells a new one-token request"),
        (ex.BUILDER_AS_SHIPPED, "no definition of CommonAttentionMetadata"),
        (ex.BUILDER_COUNTS_IN_ONE_NAME, "not unpacked into four names"),
        (ex.BUILDER_OWN_REPLACE, "binds its own 'replace'"),
        (ex.BUILDER_TREAT_FLAG, "treat_short_extends_as_decodes is not a constant"),
    )


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


def _binds_replace_ast(module: ast.Module) -> bool:
    """:func:`_binds_replace` read from the module's ast (run over its
    methods alone, the codemod's own tree is not the module)."""
    for node in module.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if node.name == "replace":
                return True
        elif isinstance(node, ast.Assign):
            if any(isinstance(t, ast.Name) and t.id == "replace" for t in node.targets):
                return True
        elif isinstance(node, ast.ImportFrom):
            if any(a.name == "*" for a in node.names) or node.module == "dataclasses":
                continue
            if any((a.asname or a.name) == "replace" for a in node.names):
                return True
    return False
