"""The sweep (issue 24, item 1): every call handed the spec index or slots,
found by syntax alone, and held against what the analysis accounted for.

Three parts, each on snippets written here:

1. ``FOUND``: every shape a call can receive the spec state slots or a spec
   token index through, and every way a kernel can be named; each must be
   found, with its field and shape. ``NOT_FOUND``: what must not be reported
   (benign kernels, row gathers, metadata reads, a function that only reads
   ``spec_token_indx`` for an ``index_select``, a kernel's own wrapper, ...).
2. Names and positions: the sweep names functions as the resolver does, and
   the analysis's calls are placed where ``ast`` puts them.
3. Through ``scan`` and ``apply``: the kernel shapes the analysis does not
   follow are ``unknown`` sites (never "no GDN spec path found", never exit
   0), ``apply`` refuses and writes nothing, and the message says what to do.

The sweep is imported where it is used: the scan-level tests run against any
version of the tool.
"""

from __future__ import annotations

import ast
import json
import textwrap
from pathlib import Path
from typing import Any

import libcst as cst
import pytest
from libcst.metadata import MetadataWrapper, PositionProvider

from gdn_backport.cli import main
from gdn_backport.patchsets.pr51812.config import KernelSpec, Patchset, load
from gdn_backport.patchsets.pr51812.scan import scan_tree, scan_tree_full
from tests.test_chains import tree
from tests.test_fork_shapes import KERNEL, REST, SITE, with_call

HEAD = f"""\
import functools
import torch
from fla import ops
from fla.ops import {KERNEL}
from fla.ops import {KERNEL} as fsg
from vllm.conv import causal_conv1d_update
from gdn_backport_kernels import gather_token_rows

"""
K = KERNEL
SLOTS = "md.spec_state_indices_tensor"


def layer(body: str, head: str = "", cls: str = "", tail: str = "") -> str:
    """A module with ``body`` as the method ``Layer._forward_core``."""
    method = textwrap.indent(textwrap.dedent(body).strip() + "\n", " " * 8)
    extra = textwrap.indent(textwrap.dedent(cls).strip() + "\n\n", " " * 4) if cls else ""
    text = HEAD + textwrap.dedent(head) + "\n\nclass Layer:\n" + extra
    text += "    def _forward_core(self, q, k, v, a, b, md, out):\n" + method
    return text + textwrap.dedent(tail)


def swept(text: str, patchset: Patchset | None = None) -> list[Any]:
    from gdn_backport.patchsets.pr51812.sweep import Vocabulary, sweep

    vocab = Vocabulary.of(patchset or load())
    return sweep("m.py", ast.parse(text), text, vocab)


def fork_kernels() -> Patchset:
    spec = KernelSpec(
        "fork_gdn", ("q", "a", "b", "slots"), ("q",), ("a", "b"), "slots", None, True, None, "x"
    )
    return load().with_kernels([spec])


# -- 1. what is found, what is not ------------------------------------------------------

# name -> (the module, callee as written, field, a part of the shape, a kernel?)
FOUND: dict[str, tuple[str, str, str, str, bool]] = {
    "keyword": (
        layer(f"out[:] = {K}(q=q, a=a, b=b, ssm_state_indices={SLOTS})"),
        K, "spec_state_indices_tensor", f"ssm_state_indices={SLOTS}", True,
    ),
    "positional_via_local": (
        layer(f"""
            slots = {SLOTS}
            {K}(None, a, b, None, q, k, v, None, None, None, None, True, None, slots)
        """),
        K, "spec_state_indices_tensor", "slots", True,
    ),
    "star_star_dict_display": (
        layer(f'{K}(**{{"q": q, "a": a, "ssm_state_indices": {SLOTS}}})'),
        K, "spec_state_indices_tensor", "**{", True,
    ),
    "star_star_dict_call": (
        layer(f"{K}(**dict(q=q, a=a, b=b, ssm_state_indices={SLOTS}))"),
        K, "spec_state_indices_tensor", "**dict(ssm_state_indices=", True,
    ),
    "star_tuple": (
        layer(f"{K}(*(None, a, b, None, q, k, v, None, None, None, None, True, None, {SLOTS}))"),
        K, "spec_state_indices_tensor", "*(", True,
    ),
    "star_list": (
        layer(f"{K}(*[None, a, b, None, q, k, v, None, None, None, None, True, None, {SLOTS}])"),
        K, "spec_state_indices_tensor", "*[", True,
    ),
    "kwargs_filled_by_update": (
        layer(f"""
            kw = dict(q=q, a=a, b=b)
            kw.update(ssm_state_indices={SLOTS})
            {K}(**kw)
        """),
        K, "spec_state_indices_tensor", "**kw (filled with", True,
    ),
    "kwargs_filled_by_item": (
        layer(f"""
            kw = {{}}
            kw["ssm_state_indices"] = {SLOTS}
            {K}(q=q, a=a, b=b, **kw)
        """),
        K, "spec_state_indices_tensor", "**kw (filled with", True,
    ),
    "kwargs_merged_by_dict": (
        layer(f"""
            base = {{"q": q, "a": a, "b": b}}
            spec = {{"ssm_state_indices": {SLOTS}}}
            {K}(**dict(base, **spec))
        """),
        K, "spec_state_indices_tensor", "**dict(", True,
    ),
    "kwargs_augmented": (
        layer(f"""
            kw = {{"q": q}}
            kw |= {{"ssm_state_indices": {SLOTS}}}
            {K}(**kw)
        """),
        K, "spec_state_indices_tensor", "**kw", True,
    ),
    "kwargs_from_a_nested_call": (
        layer(f"{K}(q=q, **self.spec_kwargs(a, b, {SLOTS}))"),
        K, "spec_state_indices_tensor", "self.spec_kwargs(...) handed", True,
    ),
    "value_from_a_nested_call": (
        layer(f"{K}(q=q, a=a, b=b, ssm_state_indices=self.pick({SLOTS}))"),
        K, "spec_state_indices_tensor", "ssm_state_indices=self.pick(...)", True,
    ),
    "kernel_inside_a_lambda": (
        layer(f"""
            slots = {SLOTS}
            run = lambda: {K}(q=q, a=a, b=b, ssm_state_indices=slots)
            out[:] = run()
        """),
        K, "spec_state_indices_tensor", "ssm_state_indices=slots", True,
    ),
    "lambda_handed_on": (
        layer(f"""
            slots = {SLOTS}
            self.capture(lambda: {K}(**dict(q=q, a=a, b=b, ssm_state_indices=slots)))
        """),
        "self.capture", "spec_state_indices_tensor", "a lambda closing over slots", False,
    ),
    "nested_def_handed_on": (
        layer(f"""
            slots = {SLOTS}
            def step():
                return {K}(q=q, a=a, b=b, ssm_state_indices=slots)
            self.capture(step)
        """),
        "self.capture", "spec_state_indices_tensor", "def step closing over slots", False,
    ),
    "partial_then_called": (
        layer(f"""
            spec = functools.partial({K}, ssm_state_indices={SLOTS})
            out[:] = spec(q=q, a=a, b=b)
        """),
        "spec", "spec_state_indices_tensor", "its callee spec = functools.partial(", True,
    ),
    "partial_bound_to_a_helpers_result": (
        layer(f"""
            spec = functools.partial({K}, **dict(**self.pack({SLOTS})))
            out[:] = spec(q=q, a=a, b=b)
        """),
        "spec", "spec_state_indices_tensor", "its callee spec = functools.partial(", True,
    ),
    "lambda_forwarding_to_the_kernel": (
        layer(f"""
            run = lambda *args, **kw: {K}(*args, **kw)
            out[:] = run(q, a, b, ssm_state_indices={SLOTS})
        """),
        "run", "spec_state_indices_tensor", "ssm_state_indices=", True,
    ),
    "partial_of_an_alias_in_a_lambda": (
        layer(f"""
            kern = ops.{K}
            run = lambda: functools.partial(kern, **dict(**{{"ssm_state_indices": {SLOTS}}}))
            out[:] = run()(q=q, a=a, b=b)
        """),
        "run()", "spec_state_indices_tensor", "**dict(**{", True,
    ),
    "local_alias": (
        layer(f"""
            kern = {K}
            kern(**dict(q=q, ssm_state_indices={SLOTS}))
        """),
        "kern", "spec_state_indices_tensor", "**dict(", True,
    ),
    "module_attribute_alias": (
        layer(f"""
            kern = ops.{K}
            kern(q=q, ssm_state_indices={SLOTS})
        """),
        "kern", "spec_state_indices_tensor", f"ssm_state_indices={SLOTS}", True,
    ),
    "getattr_alias": (
        layer(f"""
            kern = getattr(ops, "{K}")
            kern(q=q, ssm_state_indices={SLOTS})
        """),
        "kern", "spec_state_indices_tensor", "ssm_state_indices=", True,
    ),
    "dispatch_table_of_the_module": (
        layer(
            f'KERNELS["spec"](q=q, ssm_state_indices={SLOTS})',
            head=f'KERNELS = {{"spec": {K}, "plain": None}}\n',
        ),
        "KERNELS['spec']", "spec_state_indices_tensor", "ssm_state_indices=", True,
    ),
    "dispatch_table_of_the_class": (
        layer(f'self.T["spec"](q=q, ssm_state_indices={SLOTS})', cls=f"T = {{'spec': {K}}}"),
        "self.T['spec']", "spec_state_indices_tensor", "ssm_state_indices=", True,
    ),
    "conditional_callee": (
        layer(f"(torch.ops.fork.gdn if self.slow else fsg)(q=q, ssm_state_indices={SLOTS})"),
        "torch.ops.fork.gdn if self.slow else fsg", "spec_state_indices_tensor", "ssm_state_ind",
        True,
    ),
    "import_alias": (
        layer(f"fsg(q=q, a=a, b=b, ssm_state_indices={SLOTS})"),
        "fsg", "spec_state_indices_tensor", "ssm_state_indices=", True,
    ),
    "attribute_bound_to_the_kernel": (
        layer(
            f"self._spec(**dict(q=q, ssm_state_indices={SLOTS}))",
            cls=f"def __init__(self):\n    self._spec = {K}",
        ),
        "self._spec", "spec_state_indices_tensor", "**dict(", True,
    ),
    "getattr_of_the_field": (
        layer('self.helper(q, getattr(md, "spec_token_indx"))'),
        "self.helper", "spec_token_indx", "getattr(md, 'spec_token_indx')", False,
    ),
    "subscript_of_the_field": (
        layer('self.helper(q, slots=md["spec_state_indices_tensor"])'),
        "self.helper", "spec_state_indices_tensor", "slots=md['spec_state_indices_tensor']", False,
    ),
    "get_of_the_field": (
        layer('idx = md.get("spec_token_indx")\nself.helper(q, idx)'),
        "self.helper", "spec_token_indx", "idx", False,
    ),
    "parameter_named_like_a_field": (
        layer("pass", tail="\n\ndef spec_step(q, spec_state_indices_tensor):\n"
              "    return torch.ops.fork.gdn(q, spec_state_indices_tensor)\n"),
        "torch.ops.fork.gdn", "spec_state_indices_tensor", "spec_state_indices_tensor", False,
    ),
    "walrus": (
        layer(f"if (slots := {SLOTS}) is not None:\n    self.run(q, slots)"),
        "self.run", "spec_state_indices_tensor", "slots", False,
    ),
    "for_target": (
        layer(f"for slots in ({SLOTS}, None):\n    self.run(q, slots)"),
        "self.run", "spec_state_indices_tensor", "slots", False,
    ),
    "with_target": (
        layer(f"with self.pinned({SLOTS}) as slots:\n    out[:] = {K}(q=q, **dict(s=slots))"),
        K, "spec_state_indices_tensor", "**dict(s=slots", True,
    ),
    "tuple_unpacking": (
        layer(f"slots, acc = {SLOTS}, md.num_accepted_tokens\nself.run(q, acc, slots)"),
        "self.run", "spec_state_indices_tensor", "slots", False,
    ),
    "comprehension": (
        layer(f"parts = [int(s) for s in {SLOTS}]\nself.run(q, parts)"),
        "self.run", "spec_state_indices_tensor", "parts", False,
    ),
    "a_plumbed_value": (
        layer(f"self.run(q, {SLOTS}[:, 0].to(q.device).contiguous())"),
        "self.run", "spec_state_indices_tensor", SLOTS, False,
    ),
    "nested_function": (
        layer(f"""
            def inner(state):
                return {K}(q=q, a=a, b=b, ssm_state_indices=state.spec_state_indices_tensor)
            return inner(md)
        """),
        K, "spec_state_indices_tensor", "state.spec_state_indices_tensor", True,
    ),
    "stored_in_an_attribute": (
        layer(
            f"self._slots = {SLOTS}\nreturn self._spec(q, a, b)",
            cls=f"def _spec(self, q, a, b):\n    return {K}(**dict(q=q, s=self._slots))",
        ),
        K, "spec_state_indices_tensor", "the attribute ._slots", True,
    ),
    "module_level_code": (
        HEAD + f"STATE = load()\n{K}(**dict(ssm_state_indices=STATE.spec_state_indices_tensor))\n",
        K, "spec_state_indices_tensor", "**dict(", True,
    ),
}  # fmt: skip

NOT_FOUND: dict[str, str] = {
    "benign_conv_kernel": layer(
        f"causal_conv1d_update(q, conv_state_indices={SLOTS}[:, 0], max_query_len=4)"
    ),
    "row_gather_method": layer("x = q.index_select(0, md.spec_token_indx)\nout[:] = self.norm(x)"),
    "row_gather_torch": layer("self.norm(torch.index_select(q, 0, md.spec_token_indx))"),
    "row_gather_subscript": layer("self.norm(q[md.spec_token_indx])"),
    "row_gather_declared": layer("self.norm(gather_token_rows(a, md.spec_token_indx))"),
    "rows_scattered_back": layer("out.index_copy_(0, md.spec_token_indx, self.norm(q))"),
    "only_an_index_select": layer(
        "rows = mixed.index_select(0, md.spec_token_indx)\nreturn self.proj(rows).sum()"
    ),
    "metadata_reads": layer(
        f"n = md.spec_token_indx.numel()\n"
        f"self.run(n, len({SLOTS}), {SLOTS}.size(-1), md.spec_token_indx.shape[0])"
    ),
    "an_identity_index": layer("self.run(q[torch.arange(md.spec_token_indx.numel())])"),
    "plumbing_alone": layer(f"{SLOTS}.to(q.device)\nmd.spec_token_indx.long()"),
    "a_flag": layer("has_spec = md.spec_token_indx is not None\nself.run(q, has_spec)"),
    "the_kernel_output": layer(
        f"core, state = {K}(q=q, ssm_state_indices={SLOTS})\nself.norm(core)\nself.keep(state)",
    ),
    "a_result_kept_in_a_local": layer(f"x = self.conv(q, {SLOTS})\nout[:] = self.norm(x)"),
    "a_parameter_shadows": layer(
        f"slots = {SLOTS}\ndef helper(slots):\n    return self.run(q, slots)\nhelper(None)"
    ),
    "non_spec_fields": layer(
        "self.run(q, md.non_spec_state_indices_tensor, md.non_spec_token_indx)"
    ),
    "a_kernels_own_wrapper": HEAD.replace(f"from fla.ops import {K}\n", "")
    + f"def {K}(q, a, b, ssm_state_indices, spec_state_indices_tensor=None):\n"
    f"    return torch.ops.fla.{K}(q, a, b, ssm_state_indices, spec_state_indices_tensor)\n",
    "a_module_function_handed_on": HEAD
    + "def _impl(q, md):\n    return torch.ops.x.gdn(q, md.spec_token_indx)\n\n\n"
    "def register():\n    direct_register_custom_op(op_func=_impl)\n",
}
# Found in those, besides what must not be: the calls that are the point.
EXPECTED_IN_NOT_FOUND = {
    "the_kernel_output": [K],
    "a_result_kept_in_a_local": ["self.conv"],
    "a_module_function_handed_on": ["torch.ops.x.gdn"],
}


@pytest.mark.parametrize("name", sorted(FOUND))
def test_every_shape_is_found(name: str) -> None:
    text, callee, field, shape, kernel = FOUND[name]
    compile(text, name, "exec")
    found = swept(text)
    mine = [r for r in found if r.callee == callee]
    assert mine, (name, [(r.callee, r.shape) for r in found])
    r = mine[0]
    assert (r.field, r.kernel is not None) == (field, kernel), r
    assert shape in r.shape, (shape, r.shape)


@pytest.mark.parametrize("name", sorted(NOT_FOUND))
def test_what_must_not_be_reported(name: str) -> None:
    text = NOT_FOUND[name]
    compile(text, name, "exec")
    found = [r.callee for r in swept(text)]
    assert found == EXPECTED_IN_NOT_FOUND.get(name, []), found


def test_a_declared_fork_kernel_is_a_kernel_under_any_name() -> None:
    text = layer(
        f"run = functools.partial(gdn, **{{'slots': {SLOTS}}})\nout[:] = run(q, a, b)",
        head="from fork.ops import fork_gdn as gdn\n",
    )
    [r] = swept(text, fork_kernels())
    assert (r.callee, r.kernel) == ("run", "fork_gdn")
    # Unknown to the shipped patchset: still found (handed the slots), not a kernel.
    assert [(r.callee, r.kernel) for r in swept(text)] == [("run", None)]


def test_a_reassigned_name_is_reported_where_any_assignment_reaches() -> None:
    # Flow-insensitive on purpose: which assignment reaches is the
    # analysis's to say (see test_a_name_reassigned_in_another_branch_...).
    text = layer(f"""
        slots = {SLOTS}
        if md.num_decodes:
            slots = md.non_spec_state_indices_tensor
            self.run(q, slots=slots)
    """)
    [r] = swept(text)
    assert (r.callee, r.plain) == ("self.run", (("slots", -1),))


# -- 2. names and positions -------------------------------------------------------------


def test_functions_are_named_as_the_resolver_names_them() -> None:
    from gdn_backport.patchsets.pr51812.resolve import _raw_index

    text = HEAD + textwrap.dedent("""
        def twice(md):
            return torch.ops.x(md.spec_token_indx)

        def twice(md):
            return torch.ops.x(md.spec_token_indx)

        class A:
            class B:
                def m(self, md):
                    def inner():
                        return (lambda: torch.ops.y(md.spec_token_indx))()
                    return inner()

            def other(self):
                def inner():
                    pass

            def other(self, md):
                def inner():
                    return torch.ops.v(md.spec_token_indx)

            def m(self, md):
                torch.ops.z(md.spec_state_indices_tensor)
                def inner():
                    return torch.ops.w(md.spec_state_indices_tensor)

        torch.ops.top(STATE.spec_state_indices_tensor)
    """)
    found = {r.callee: (r.function, r.occurrence, r.def_line) for r in swept(text)}
    lines = {
        (qual, occurrence): node.lineno
        for kind, qual, *rest in _raw_index(ast.parse(text))
        if kind == "function"
        for occurrence, node in [rest[:2]]
    }
    for callee, (qual, occurrence, line) in found.items():
        if qual != "<module>":
            assert lines[(qual, occurrence)] == line, callee
    assert found["torch.ops.x"][:2] == ("twice", 1)  # the last one wins
    assert found["torch.ops.y"][:2] == ("A.B.m.inner", 0)  # a lambda: its def's
    assert found["torch.ops.w"][:2] == ("A.m.inner", 0)
    assert found["torch.ops.z"][:2] == ("A.m", 0)
    assert found["torch.ops.v"][:2] == ("A.other.inner", 1)  # the one not swept counts too
    assert found["torch.ops.top"][0] == "<module>"


def test_the_analysis_calls_are_placed_where_ast_puts_them() -> None:
    from gdn_backport.cst_nodes import call_positions, call_spans, span

    text = textwrap.dedent("""\
        @dec(arg())
        def f(x, y=default()):
            a = g(x) if test(x) else g(y)
            try:
                pass
            except make_error() as e:
                g(e)
            return [h(i) for i in g(x)], {"é": g(1)}, x.m().m().m(), f(g)(g)
    """)
    module = cst.parse_module(text)
    func = module.body[0]
    tree = ast.parse(text).body[0]
    pos = call_positions(func, tree)
    wanted = {span(n) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert set(pos.values()) == wanted
    # A few calls, by their print where it is unique, else in order: the same.
    calls = _cst_calls(func)
    assert call_spans(calls, func, tree, wanted) == pos
    ast_calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    [h] = [n for n in ast_calls if isinstance(n.func, ast.Name) and n.func.id == "h"]
    assert set(call_spans(calls, func, tree, {span(h)}).values()) == {span(h)}
    g = [span(n) for n in ast_calls if isinstance(n.func, ast.Name) and n.func.id == "g"]
    some = call_spans(calls, func, tree, {g[0]})  # g(x) twice: paired in order
    assert set(g) <= set(some.values()) and all(pos[k] == v for k, v in some.items())
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    where = wrapper.resolve(PositionProvider)
    lines = text.splitlines()
    for node, p in where.items():
        if isinstance(node, cst.Call):
            line, col, _, _ = pos[id(node)]
            chars = len(lines[line - 1].encode()[:col].decode())
            assert (p.start.line, p.start.column) == (line, chars)


def _cst_calls(node: cst.CSTNode) -> list[cst.Call]:
    from gdn_backport.cst_nodes import walk

    return [n for n in walk(node) if isinstance(n, cst.Call)]


# -- 3. through scan and apply ------------------------------------------------------------

# Kernel call shapes the analysis does not follow: each must be an unknown
# site (before the sweep: no site at all, or the spec call silently left out).
MISSED_SHAPES: dict[str, str | tuple[str, str]] = {
    "inline_dict": f"out_spec, _ = {KERNEL}(**dict(A_log=self.A_log, a=a, b=b, {REST}))",
    "inline_dict_of_a_display": (
        f"out_spec, _ = {KERNEL}(**dict(A_log=self.A_log, a=a, b=b, **{{'dt_bias': self.dt_bias,"
        " 'q': query_spec, 'k': key_spec, 'v': value_spec, 'initial_state': ssm_state,"
        " 'ssm_state_indices': spec_state_indices_tensor}))"
    ),
    "partial_then_called": f"""
        spec = functools.partial({KERNEL}, ssm_state_indices=spec_state_indices_tensor,
                                 num_accepted_tokens=m.num_accepted_tokens)
        out_spec, _ = spec(A_log=self.A_log, a=a, b=b, dt_bias=self.dt_bias, q=query_spec,
                           k=key_spec, v=value_spec, initial_state=ssm_state)
    """,
    "kwargs_filled_then_unpacked": f"""
        kw = dict(A_log=self.A_log, a=a, b=b, dt_bias=self.dt_bias)
        kw.update(q=query_spec, k=key_spec, v=value_spec, initial_state=ssm_state)
        kw["ssm_state_indices"] = spec_state_indices_tensor
        out_spec, _ = {KERNEL}(**dict(kw))
    """,
    # The callee is itself a call that starts where the kernel call does:
    # positions are spans, not starts.
    "getattr_in_place": f"""
        import vllm.model_executor.layers.fla.ops as fla_ops
        out_spec, _ = getattr(fla_ops, "{KERNEL}")(**dict(A_log=self.A_log, a=a, b=b, {REST}))
    """,
    # A kernel the analysis takes for an unknown callee, handed a filled
    # dict: before the sweep, "not_affected" (its splat looked uniform).
    "getattr_of_a_filled_dict": f"""
        import vllm.model_executor.layers.fla.ops as fla_ops
        kw = {{"A_log": self.A_log, "a": a, "b": b, "dt_bias": self.dt_bias, "q": query_spec,
              "k": key_spec, "v": value_spec, "initial_state": ssm_state,
              "ssm_state_indices": spec_state_indices_tensor}}
        out_spec, _ = getattr(fla_ops, "{KERNEL}")(**kw)
    """,
    # The slots stashed on the layer, read back by a method of its own.
    "stashed_on_self": (
        """
        self._spec_slots = spec_state_indices_tensor
        out_spec, _ = self._run_spec(a, b, query_spec, key_spec, value_spec, ssm_state)
    """,
        f"""
    def _run_spec(self, a, b, q, k, v, state):
        return {KERNEL}(**dict(A_log=self.A_log, a=a, b=b, dt_bias=self.dt_bias, q=q, k=k, v=v,
                               initial_state=state, ssm_state_indices=self._spec_slots))
""",
    ),
    "dispatch_table_with_inline_dict": f"""
        table = {{"spec": {KERNEL}}}
        out_spec, _ = table["spec"](**dict(A_log=self.A_log, a=a, b=b, {REST}))
    """,
}


def _shape(lines: str | tuple[str, str]) -> str:
    """The example layer with its spec call replaced by ``lines`` (and,
    given a pair, a method of the layer's own added)."""
    if isinstance(lines, tuple):
        lines, method = lines
        return "import functools\n" + with_call(lines) + method
    return "import functools\n" + with_call(lines)


@pytest.mark.parametrize("name", sorted(MISSED_SHAPES))
def test_a_shape_the_analysis_does_not_follow_is_unknown(tmp_path: Path, name: str) -> None:
    text = _shape(MISSED_SHAPES[name])
    compile(text, name, "exec")
    root = tree(tmp_path, {SITE: text})
    _, sites = scan_tree(root)
    assert sites, "no site at all: the spec call is missed silently"
    unknown = [s for s in sites if s.status == "unknown"]
    assert unknown, sites
    site = unknown[0]
    assert "which the analysis does not follow" in site.reason or (
        "under a name the analysis does not resolve" in site.reason
    )
    code, out, err = _cli("scan", str(root))
    assert code == 2 and "no GDN spec path" not in out
    before = (root / SITE).read_bytes()
    code, out, err = _cli("apply", str(root))
    assert code == 2 and site.reason in err
    assert (root / SITE).read_bytes() == before
    assert not (root / ".gdn-backport").exists()


def test_the_reason_names_the_call_the_field_and_the_shape(tmp_path: Path) -> None:
    root = tree(tmp_path, {SITE: _shape(MISSED_SHAPES["inline_dict"])})
    _, out, _ = _cli("scan", str(root), "--json")
    found = [s for s in json.loads(out)["sites"] if s["function"] == "Layer._forward_core"]
    assert len(found) == 1, found or "no site at all: the spec call is missed silently"
    site = found[0]
    line = next(
        i for i, t in enumerate((root / SITE).read_text().splitlines(), 1) if "**dict(" in t
    )
    assert site["reason"].startswith(
        f"{KERNEL}(...) at line {line} receives spec_state_indices_tensor "
        "(m.spec_state_indices_tensor) through **dict(ssm_state_indices=spec_state_indices_tensor)"
        ", which the analysis does not follow; call the kernel by its name"
    ), site["reason"]
    assert set(site) >= {"path", "line", "function", "status", "reason"}


def test_an_unknown_call_in_a_helper_is_a_site_of_its_own(tmp_path: Path) -> None:
    # The analysis finds the entry affected; the sweep finds the helper's
    # call it does not follow: both sites, apply refuses the whole run.
    helper = (
        "import torch\n\n\ndef spec_step(q, spec_state_indices_tensor):\n"
        "    return torch.ops.fork.gdn(**dict(q=q, slots=spec_state_indices_tensor))\n"
    )
    from tests.conftest import AFFECTED

    root = tree(tmp_path, {SITE: AFFECTED, "vllm/fork_ops.py": helper})
    _, sites = scan_tree(root)
    assert {(s.function, s.status) for s in sites} == {
        ("Layer._forward_core", "affected"),
        ("spec_step", "unknown"),
    }
    assert _cli("apply", str(root))[0] == 2
    assert "a=a_spec" not in (root / SITE).read_text()


def test_a_name_reassigned_in_another_branch_is_left_to_the_analysis(tmp_path: Path) -> None:
    # The sweep sees `slots` assigned the spec slots somewhere; the analysis
    # traces, path by path, that the other calls get the non-spec slots.
    text = _shape(f"""
        slots = spec_state_indices_tensor
        out_spec, _ = {KERNEL}(
            A_log=self.A_log, a=a, b=b, dt_bias=self.dt_bias, q=query_spec, k=key_spec,
            v=value_spec, initial_state=ssm_state, ssm_state_indices=slots,
            num_accepted_tokens=m.num_accepted_tokens,
        )
        if m.num_decodes > 0:
            slots = non_spec_state_indices_tensor
            self.helper(query, slots=slots)
    """)
    root = tree(tmp_path, {SITE: text})
    result = scan_tree_full(root)
    assert {s.status for s in result.sites} == {"affected"}
    assert ("self.helper", "other-rows") in {(r.callee, how) for r, how in result.analysis.swept}


def test_no_spec_path_is_said_only_where_no_call_is_found(tmp_path: Path) -> None:
    only_conv = (
        "from vllm.conv import causal_conv1d_update\n\n\n"
        "def conv(x, md):\n"
        "    return causal_conv1d_update(x, conv_state_indices=md.spec_state_indices_tensor)\n"
    )
    helper = "def step(x, md):\n    return torch.ops.fork.stats(md.spec_state_indices_tensor)\n"
    root = tree(tmp_path, {"vllm/conv_only.py": only_conv})
    code, out, _ = _cli("scan", str(root), "--patchset", "pr51812")
    assert code == 0
    assert out.rstrip().endswith("no GDN spec path, metadata builder or runner route found")
    root = tree(tmp_path / "other", {"vllm/stats.py": "import torch\n\n\n" + helper})
    code, out, _ = _cli("scan", str(root), "--patchset", "pr51812")
    assert code == 0, out
    assert "each accounted for: torch.ops.fork.stats (vllm/stats.py:5, no-rows)" in out


def _cli(*argv: str) -> tuple[int, str, str]:
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_the_sweep_lists_are_checked_on_load() -> None:
    from gdn_backport.errors import UsageError
    from gdn_backport.patchsets.pr51812.config import _sweep

    assert _sweep({}, "p.toml").plumbing == frozenset()
    assert "to" in load().sweep.plumbing and "index_select" in load().sweep.row_selection
    with pytest.raises(UsageError, match=r"p.toml: sweep: unknown key 'ignore'"):
        _sweep({"sweep": {"ignore": ["x"]}}, "p.toml")
    with pytest.raises(UsageError, match=r"p.toml: sweep: key 'metadata' must list identifiers"):
        _sweep({"sweep": {"metadata": ["a.b"]}}, "p.toml")


def test_two_copies_of_one_function_are_each_reconciled(tmp_path: Path) -> None:
    # Vendor copies (amd/, nvidia/) share the parse of a function of the
    # same text: each copy's calls are placed in its own module.
    helper = textwrap.dedent("""\
        import torch


        class Layer:
            def _forward(self, x, md):
                slots = md.spec_state_indices_tensor
                valid = slots >= 0
                return torch.where(valid, slots, torch.zeros_like(slots))
    """)
    root = tree(tmp_path, {"vllm/amd/layer.py": helper, "vllm/nvidia/layer.py": helper})
    result = scan_tree_full(root)
    assert result.sites == []
    assert {how for _, how in result.analysis.swept} == {"benign"}
    assert {r.module for r, _ in result.analysis.swept} == {
        "vllm/amd/layer.py",
        "vllm/nvidia/layer.py",
    }
