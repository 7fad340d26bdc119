"""No silent miss (issue 12, item 5), as checked properties.

1. Generated forks with a known truth: a ``_forward_core`` that selects the
   spec rows of q/k/v, hands them on through 0-6 helpers (methods, module
   functions, functions of another module; the slots passed or read from the
   metadata) to a kernel that is the patchset's, a declared fork kernel or
   an unknown one, with raw or gathered gates (some staged through None).
   scan must give exactly the status the construction implies; an affected
   one must patch to fixed and revert byte for byte.
2. An independent oracle over the corpus and real releases: every function
   with a call handed the spec state slots (read syntactically with ``ast``)
   that is not a PyTorch op must show up in scan's output, as a site or on a
   site's chain; "no GDN spec path found" only where no such call exists.
3. The sweep (issue 24): the spec call of each affected release, rewritten
   into shapes no analysis follows (``**dict(...)`` inline, partials over
   aliases inside lambdas, dispatch tables, filled kwargs, ... combined and
   nested), never leaves the release clean: ``scan`` and ``apply --check``
   exit 1 (affected) or 2 (unknown), never 0.
"""

from __future__ import annotations

import ast
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import libcst as cst
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gdn_backport import sources
from gdn_backport.cli import main
from gdn_backport.cst_nodes import code
from gdn_backport.patchsets.pr51812.config import load
from gdn_backport.patchsets.pr51812.dataflow import MAX_DEPTH
from gdn_backport.patchsets.pr51812.scan import analyse_tree
from tests import corpus
from tests.corpus.variants import Subject

KERNEL = "fused_sigmoid_gating_delta_rule_update"


@dataclass(frozen=True)
class Fork:
    hops: tuple[str, ...]  # "method" | "function" | "imported", entry first
    kernel: str  # "known" | "declared" | "unknown"
    gates: str  # "raw" | "gathered" | "staged_raw" | "staged_gathered"
    fast_path: bool
    subscript: bool  # x[idx] rather than x.index_select(0, idx)
    metadata: bool  # the last helper reads the slots from the metadata

    @property
    def expected(self) -> str:
        if len(self.hops) > MAX_DEPTH:
            return "unknown"
        raw = self.gates in ("raw", "staged_raw")
        if self.kernel == "unknown":
            return "unknown" if raw else "not_affected"
        return "affected" if raw else "fixed"


def _select(fork: Fork, base: str) -> str:
    return f"{base}[idx]" if fork.subscript else f"{base}.index_select(0, idx)"


def _call(kind: str, i: int, inst: str, args: str) -> str:
    return f"{inst}._h{i}({args})" if kind == "method" else f"h{i}({inst}, {args})"


def render(fork: Fork) -> dict[str, str]:
    """The fork's files: ``vllm/gdn.py`` (and ``vllm/spec.py``, the overlay)."""
    params = "a, b, q, k, v, md" if fork.metadata else "a, b, q, k, v, slots, acc"
    name = {"known": KERNEL, "declared": "fork_gdn", "unknown": "torch.ops.fork.gdn"}
    slots, acc = ("md.spec_state_indices_tensor", "md.num_accepted_tokens")
    if not fork.metadata:
        slots, acc = "slots", "acc"

    def kernel(indent: str, a: str, b: str) -> str:
        return (
            f"{name[fork.kernel]}(\n"
            f"{indent}    A_log=None, a={a}, b={b}, dt_bias=None, q=q, k=k, v=v,\n"
            f"{indent}    ssm_state_indices={slots}, num_accepted_tokens={acc},\n"
            f"{indent})"
        )

    raw = fork.gates in ("raw", "staged_raw")
    # Staged gates: locals that start as None, set under `is None` guards.
    src_a, src_b = ("a_s", "b_s") if fork.gates.startswith("staged") else ("a", "b")
    gate_a = src_a if raw else _select(fork, src_a)
    gate_b = src_b if raw else _select(fork, src_b)
    body = [
        "    def _forward_core(self, mixed_qkv, b, a, out):",
        "        md = self.metadata()",
        "        idx = md.spec_token_indx",
        "        slots = md.spec_state_indices_tensor",
        "        acc = md.num_accepted_tokens",
    ]
    if fork.gates.startswith("staged"):
        body += [
            "        a_s = None",
            "        b_s = None",
            "        if a_s is None:",
            "            a_s = a",
            "        if b_s is None:",
            "            b_s = b",
        ]
    gather = _select(fork, "mixed_qkv")
    if fork.fast_path:
        body += [
            "        if md.num_prefills == 0 and md.num_decodes == 0:",
            "            x = mixed_qkv",
            f"            a_g, b_g = {src_a}, {src_b}",
            "        else:",
            f"            a_g, b_g = {gate_a}, {gate_b}",
            f"            x = {gather}",
        ]
    else:
        body += [f"        a_g, b_g = {gate_a}, {gate_b}", f"        x = {gather}"]
    body.append("        q, k, v = self.rearrange_mixed_qkv(x)")
    first = params.replace("a, b,", "a_g, b_g,", 1)
    if fork.hops:
        body.append(f"        out[:] = {_call(fork.hops[0], 0, 'self', first)}")
    else:
        body.append(f"        out[:] = {kernel('        ', 'a_g', 'b_g')}")
    methods, functions, imported = [], [], []
    for i, kind in enumerate(fork.hops):
        inst = "self" if kind == "method" else "layer"
        if i + 1 < len(fork.hops):
            ret = _call(fork.hops[i + 1], i + 1, inst, params)
        else:
            ret = kernel("    " if kind != "method" else "        ", "a", "b")
        if kind == "method":
            methods.append(f"    def _h{i}(self, {params}):\n        return {ret}\n")
        else:
            text = f"def h{i}(layer, {params}):\n    return {ret}\n"
            (imported if kind == "imported" else functions).append(text)
    own = [f"h{i}" for i, k in enumerate(fork.hops) if k == "function"]
    theirs = [f"h{i}" for i, k in enumerate(fork.hops) if k == "imported"]
    kernel_line = [f"fork_gdn = {KERNEL}"] if fork.kernel == "declared" else []
    header = ["import torch", f"from vllm.ops import {KERNEL}", *kernel_line]
    if theirs:
        header.append(f"from vllm.spec import {', '.join(theirs)}")
    gdn = "\n".join(header) + "\n\n\n" + "".join(f + "\n\n" for f in functions)
    gdn += "class Layer:\n" + "\n".join(body) + "\n" + "".join("\n" + m for m in methods)
    files = {"vllm/__init__.py": "", "vllm/gdn.py": gdn}
    if imported:
        spec = ["import torch", f"from vllm.ops import {KERNEL}", *kernel_line]
        if own:
            spec.append(f"from vllm.gdn import {', '.join(own)}")
        files["vllm/spec.py"] = "\n".join(spec) + "\n\n\n" + "\n\n".join(imported)
    if fork.kernel == "declared":
        files[".gdn-backport.toml"] = (
            '[[kernel]]\nname = "fork_gdn"\n'
            'params = ["A_log", "a", "b", "dt_bias", "q", "k", "v", "ssm_state_indices",'
            ' "num_accepted_tokens"]\n'
            'rows = ["q", "k", "v"]\ngates = ["a", "b"]\n'
            'state_indices = "ssm_state_indices"\naccepted = "num_accepted_tokens"\n'
            "fix_target = true\n"
        )
    return files


forks = st.builds(
    Fork,
    hops=st.lists(st.sampled_from(["method", "function", "imported"]), max_size=6).map(tuple),
    kernel=st.sampled_from(["known", "declared", "unknown"]),
    gates=st.sampled_from(["raw", "gathered", "staged_raw", "staged_gathered"]),
    fast_path=st.booleans(),
    subscript=st.booleans(),
    metadata=st.booleans(),
)


def _cli(*argv: str) -> tuple[int, str]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(list(argv))
    return code, out.getvalue()


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(fork=forks)
def test_generated_forks_get_the_status_their_construction_implies(
    tmp_path_factory: pytest.TempPathFactory, fork: Fork
) -> None:
    root = tmp_path_factory.mktemp("fork")
    for rel, text in render(fork).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    code, out = _cli("scan", str(root), "--json")
    sites = json.loads(out)["sites"]
    entry = [s for s in sites if s["function"] == "Layer._forward_core"]
    assert len(entry) == 1, (fork, sites)
    assert entry[0]["status"] == fork.expected, (fork, entry[0])
    if fork.hops and fork.expected != "unknown":
        assert entry[0]["via"][0] == "Layer._forward_core"
    assert "no GDN spec path found" not in _cli("scan", str(root))[1]
    if fork.expected != "affected":
        return
    before = (root / "vllm/gdn.py").read_bytes()
    spec_before = (root / "vllm/spec.py").read_bytes() if "imported" in fork.hops else b""
    code, out = _cli("apply", str(root), "--json")
    assert code == 0, (fork, out)
    code, out = _cli("scan", str(root), "--json")
    [after] = [s for s in json.loads(out)["sites"] if s["function"] == "Layer._forward_core"]
    assert after["status"] == "fixed", (fork, after)
    if spec_before:
        assert (root / "vllm/spec.py").read_bytes() == spec_before  # helpers untouched
    assert _cli("revert", str(root))[0] == 0
    assert (root / "vllm/gdn.py").read_bytes() == before


# -- the oracle over real code -------------------------------------------------------

_TORCH_METHODS = frozenset(
    {"to", "index_select", "copy_", "index_copy_", "contiguous", "view", "reshape", "size",
     "numel", "fill_", "long", "int", "clone", "narrow", "select", "__getitem__", "split",
     "unsqueeze", "squeeze", "flatten", "repeat", "expand", "new_tensor", "masked_fill_",
     "index_fill_", "cpu", "cuda", "tolist", "item", "zero_", "T", "gather", "scatter_"}
)  # fmt: skip


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def slot_consumers(text: str) -> set[str]:
    """Qualnames of functions with a call handed the spec state slots: an
    argument reading a spec-state field, or a local assigned from one, that
    is not a PyTorch op, a builtin or a class built (read with ast alone)."""
    fields = load().fields.spec_state
    found: set[str] = set()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                qual = f"{prefix}{child.name}"
                if _consumes(child, fields):
                    found.add(qual)
                visit(child, f"{qual}.")
            else:
                visit(child, prefix)

    tree = ast.parse(text)
    imports = {
        a.asname or a.name: f"{n.module}.{a.name}"
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module
        for a in n.names
    }
    _IMPORTS.clear()
    _IMPORTS.update(imports)
    visit(tree, "")
    return found


# What the names of the module being read import (the oracle's one table).
_IMPORTS: dict[str, str] = {}
_STDLIB = ("dataclasses.", "copy.", "functools.", "itertools.", "typing.", "math.")


def _consumes(fn: ast.FunctionDef | ast.AsyncFunctionDef, fields: frozenset[str]) -> bool:
    tainted: set[str] = set()

    def reads(node: ast.AST) -> bool:
        return any(
            (isinstance(n, ast.Attribute) and n.attr in fields)
            or (isinstance(n, ast.Name) and n.id in tainted)
            for n in ast.walk(node)
        )

    for _ in range(3):
        for n in ast.walk(fn):
            if isinstance(n, ast.Assign) and reads(n.value):
                tainted |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    for n in ast.walk(fn):
        if not isinstance(n, ast.Call):
            continue
        callee = _dotted(n.func)
        head, _, rest = callee.partition(".")
        if head in _IMPORTS:
            callee = f"{_IMPORTS[head]}.{rest}" if rest else _IMPORTS[head]
        short = callee.rsplit(".", 1)[-1]
        if (
            (callee.startswith("torch.") and not callee.startswith("torch.ops."))
            or short in _TORCH_METHODS
            or short[:1].isupper()
            or ("." not in callee and callee in dir(__builtins__))
            or short in load().benign
            or callee.startswith(_STDLIB)
        ):
            continue
        if any(reads(a) for a in [*n.args, *(k.value for k in n.keywords)]):
            return True
    return False


def _missed(root: Path) -> list[tuple[str, str]]:
    """Functions the oracle finds that no classified call's chain passes
    through (a site, or a link of a site's chain)."""
    analysis = analyse_tree(root)
    reported = {f.qualname for call in analysis.calls() for f in call.chain}
    reported |= {key[1] for key in analysis.sites}
    patchset = load()
    missed = []
    for path in sorted(root.rglob("*.py")):
        data = path.read_bytes()
        if not any(f.encode() in data for f in patchset.fields.spec_state):
            continue
        for qual in sorted(slot_consumers(data.decode("utf-8"))):
            if qual.rsplit(".", 1)[-1] in patchset.kernels:
                continue  # the kernel's own wrapper: its callers are the sites
            if qual not in reported:
                missed.append((path.relative_to(root).as_posix(), qual))
    return missed


@functools.cache
def _release_root(version: str) -> Path:
    return sources.release_tree(version)


@pytest.mark.network
@pytest.mark.parametrize("version", ["0.18.1", "0.21.0", "0.27.1", "0.33.0"])
def test_every_slot_consumer_of_a_release_is_reported(version: str) -> None:
    assert _missed(_release_root(version)) == []


@pytest.mark.network
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    version=st.sampled_from([lay.version for lay in corpus.LAYOUTS]),
    name=st.sampled_from([v.name for v in corpus.VARIANTS]),
)
def test_every_slot_consumer_of_a_corpus_variant_is_reported(
    tmp_path_factory: pytest.TempPathFactory, version: str, name: str
) -> None:
    lay = corpus.layout(version)
    root = tmp_path_factory.mktemp("variant")
    target = root / lay.path
    target.parent.mkdir(parents=True)
    original = (_release_root(version) / lay.path).read_text(encoding="utf-8")
    text, files = corpus.variant_files(original, lay, corpus.variant(name))
    target.write_text(text)
    for rel, content in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(content)
    assert _missed(root) == []


# -- the sweep: the spec call in shapes no analysis follows (issue 24) -------------------------

# One affected release per GDN module path (0.18.1, 0.21.0, 0.27.1).
SHAPED = [lay.version for lay in corpus.LAYOUTS]


@functools.cache
def _spec_call(version: str) -> tuple[str, tuple[tuple[str, str], ...], str]:
    """The release's GDN module, its spec call's keyword arguments (each
    value on one line, its comments dropped) and the kernel's module."""
    lay = corpus.layout(version)
    text = (_release_root(version) / lay.path).read_text(encoding="utf-8")
    subject = Subject(text, lay.cls, lay)
    kwargs = []
    for arg in subject.spec_call().args:
        assert arg.keyword is not None and not arg.star, "every release passes keywords"
        value = ast.unparse(ast.parse(code(arg.value).strip(), mode="eval"))
        kwargs.append((arg.keyword.value, value))
    return text, tuple(kwargs), subject.kernel_module()


def reshaped(version: str, prelude: str, expr: str) -> str:
    """The release's GDN module, its spec call replaced by ``expr`` and
    ``prelude`` (statements) put before the statement that holds it."""
    lay = corpus.layout(version)
    subject = Subject(_spec_call(version)[0], lay.cls, lay)
    call = subject.spec_call()
    if prelude:
        subject.insert_before(subject.statement_of(call), prelude)
    subject.set_call(call, cst.parse_expression(expr))
    return subject.module.code


@functools.cache
def _shaped_root(base: str, version: str) -> Path:
    root = Path(base) / f"shaped-{version}"
    (root / corpus.layout(version).path).parent.mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    return root


def shaped_tree(factory: pytest.TempPathFactory, version: str, text: str) -> Path:
    """The one temporary tree of ``version`` (its GDN module alone), holding ``text``."""
    root = _shaped_root(str(factory.getbasetemp()), version)
    (root / corpus.layout(version).path).write_text(text, encoding="utf-8")
    return root


@pytest.mark.network
@pytest.mark.parametrize("version", SHAPED)
def test_the_inline_dict_shape_of_each_affected_release_is_unknown(
    tmp_path_factory: pytest.TempPathFactory, version: str
) -> None:
    # Before the sweep: "no GDN spec path, metadata builder or runner route
    # found" and exit 0 on each of them: a silent miss.
    lay = corpus.layout(version)
    inline = ", ".join(f"{k}={v}" for k, v in _spec_call(version)[1])
    text = reshaped(version, "", f"{KERNEL}(**dict({inline}))")
    root = shaped_tree(tmp_path_factory, version, text)
    code_, out = _cli("scan", str(root), "--patchset", "pr51812", "--json")
    found = [s for s in json.loads(out)["sites"] if s["function"] == f"{lay.cls}._forward_core"]
    assert len(found) == 1, (code_, found or "no site at all: the spec call is missed silently")
    site = found[0]
    assert (code_, site["status"]) == (2, "unknown"), site
    assert "through **dict(ssm_state_indices=spec_state_indices_tensor)" in site["reason"]
    assert "no GDN spec path" not in _cli("scan", str(root), "--patchset", "pr51812")[1]
    assert _cli("apply", "--check", str(root), "--patchset", "pr51812")[0] == 2
    assert _cli("apply", str(root), "--patchset", "pr51812")[0] == 2
    assert (root / lay.path).read_text(encoding="utf-8") == text
    assert not (root / ".gdn-backport" / "manifest.json").exists()


@dataclass(frozen=True)
class CallShape:
    """The spec call rewritten: how its callee is named (innermost first),
    how its arguments are packed (outermost first), what wraps the call."""

    callee: tuple[str, ...]
    packing: tuple[str, ...]
    call: str  # "plain" | "partial" | "lambda_in_place"
    wrappers: tuple[str, ...]  # "lambda" | "def", innermost first

    def render(self, kwargs: tuple[tuple[str, str], ...], module: str) -> tuple[str, str]:
        """(the statements before the call, the expression of the call)."""
        prelude: list[str] = []
        n = iter(range(1000))

        def fresh(stem: str) -> str:
            return f"_gdn_{stem}{next(n)}"

        callee = KERNEL
        for form in self.callee:
            name = fresh(form)
            if form == "alias":
                prelude.append(f"{name} = {callee}")
                callee = name
            elif form == "module" and callee == KERNEL:
                prelude.append(f"import {module} as {name}")
                callee = f"{name}.{KERNEL}"
            elif form == "getattr" and callee == KERNEL:
                prelude.append(f"import {module} as {name}")
                callee = f'getattr({name}, "{KERNEL}")'
            elif form == "import_alias" and callee == KERNEL:
                prelude.append(f"from {module} import {KERNEL} as {name}")
                callee = name
            elif form == "table":
                prelude.append(f'{name} = {{"spec": {callee}, "decode": None}}')
                callee = f'{name}["spec"]'
            elif form == "conditional":
                callee = f"({callee} if spec_token_indx is not None else {callee})"
            elif form == "lambda":
                prelude.append(f"{name} = lambda: {callee}")
                callee = f"{name}()"

        def mapping(items: list[tuple[str, str]], packing: tuple[str, ...]) -> str:
            pairs = ", ".join(f'"{k}": {v}' for k, v in items)
            if not packing or not items:
                return "{" + pairs + "}"
            head, rest = packing[0], packing[1:]
            if head in ("dict", "star"):  # no positions in a mapping
                return f"dict({arguments(items, rest)})"
            if head == "display":
                return "{**" + mapping(items, rest) + "}"
            if head == "local":
                name = fresh("kw")
                prelude.append(f"{name} = {mapping(items, rest)}")
                return name
            if head == "filled":
                name = fresh("kw")
                half = len(items) // 2
                prelude.append(f"{name} = {mapping(items[:half], rest)}")
                prelude.append(f"{name}.update({arguments(items[half:-1], ())})")
                prelude.append(f'{name}["{items[-1][0]}"] = {items[-1][1]}')
                return name
            if head == "merged":
                half = len(items) // 2
                return f"dict({mapping(items[:half], rest)}, **{mapping(items[half:], rest)})"
            assert head == "helper"
            return f"dict(**self._gdn_pack({arguments(items, rest)}))"

        def arguments(items: list[tuple[str, str]], packing: tuple[str, ...]) -> str:
            if not items:
                return ""
            if not packing:
                return ", ".join(f"{k}={v}" for k, v in items)
            if packing[0] == "star":
                rest = tuple(p for p in packing[1:] if p != "star")
                if len(items) <= 7:
                    return arguments(items, rest)
                # The leading parameters by position, packed into a tuple.
                lead = ", ".join(v for _, v in items[:7])
                more = arguments(items[7:], rest)
                return f"*({lead},)" + (f", {more}" if more else "")
            return "**" + mapping(items, packing)

        items = list(kwargs)
        if self.call == "partial":
            bound = [kv for kv in items if kv[0] in ("ssm_state_indices", "num_accepted_tokens")]
            rest = [kv for kv in items if kv not in bound]
            prelude.append("import functools")
            name = fresh("partial")
            packing = tuple(p for p in self.packing if p != "star")
            prelude.append(f"{name} = functools.partial({callee}, {arguments(bound, packing)})")
            expr = f"{name}({arguments(rest, self.packing)})"
        elif self.call == "lambda_in_place":
            expr = f"(lambda *_a, **_kw: {callee}(*_a, **_kw))({arguments(items, self.packing)})"
        else:
            expr = f"{callee}({arguments(items, self.packing)})"
        for wrapper in self.wrappers:
            name = fresh(wrapper)
            if wrapper == "lambda":
                prelude.append(f"{name} = lambda: {expr}")
            else:
                prelude.append(f"def {name}():\n    return {expr}")
            expr = f"{name}()"
        return "\n".join(prelude) + ("\n" if prelude else ""), expr


call_shapes = st.builds(
    CallShape,
    callee=st.lists(
        st.sampled_from(["alias", "module", "getattr", "import_alias", "table", "conditional",
                         "lambda"]),
        max_size=3,
    ).map(tuple),
    packing=st.lists(
        st.sampled_from(["dict", "display", "local", "filled", "merged", "helper", "star"]),
        max_size=3,
    ).map(tuple),
    call=st.sampled_from(["plain", "partial", "lambda_in_place"]),
    wrappers=st.lists(st.sampled_from(["lambda", "def"]), max_size=2).map(tuple),
)  # fmt: skip


@pytest.mark.network
@settings(
    max_examples=120,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(version=st.sampled_from(SHAPED), shape=call_shapes)
def test_no_shape_of_the_spec_call_passes_an_affected_release(
    tmp_path_factory: pytest.TempPathFactory, version: str, shape: CallShape
) -> None:
    """Whatever shape the spec call takes, the affected release never comes
    out clean: affected (1) where the analysis follows the shape, unknown (2)
    where it does not; never 0."""
    _, kwargs, module = _spec_call(version)
    prelude, expr = shape.render(kwargs, module)
    text = reshaped(version, prelude, expr)
    compile(text, "shape", "exec")
    root = shaped_tree(tmp_path_factory, version, text)
    scan = _cli("scan", str(root), "--patchset", "pr51812")
    check = _cli("apply", "--check", str(root), "--patchset", "pr51812")
    assert scan[0] in (1, 2) and check[0] in (1, 2), (shape, prelude, expr, scan[1])
    if shape == CallShape((), (), "plain", ()):
        assert scan[0] == check[0] == 1  # the release as it is: affected
