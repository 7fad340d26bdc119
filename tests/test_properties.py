"""Properties of scan / apply / revert over generated sources (hypothesis).

Sources come from a small grammar of GDN spec paths written here: a function
or method that gathers q/k/v rows by a spec index (``index_select``,
``torch.index_select``, a subscript, a mask), maybe with the pure-spec fast
path, calls the spec kernel with keyword or positional arguments in any
order, and has unrelated statements, branches, loops, comments and gate
edits sprinkled anywhere. Whatever comes out:

* ``revert(apply(x)) == x`` byte for byte, and a refused ``apply`` leaves
  ``x`` as it was;
* ``apply(apply(x)) == apply(x)``;
* ``scan`` never raises anything but the documented ``UsageError`` (bad
  input, one line naming the file), on these sources, on them cut and
  shuffled, and on random text.
"""

from __future__ import annotations

import keyword
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gdn_backport import atomic
from gdn_backport.errors import UsageError
from gdn_backport.patchsets.pr51812.config import load
from gdn_backport.patchsets.pr51812.plan import apply_tree
from gdn_backport.patchsets.pr51812.scan import scan_text
from gdn_backport.pipeline import revert_tree
from gdn_backport.site import Status

KERNEL = "fused_sigmoid_gating_delta_rule_update"
RESERVED = {"torch", "self", "range", "len", "print", "dict", "None", "ctx", "KERNEL", "mask"}
SETTINGS = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

identifier = st.from_regex(r"[a-z][a-z0-9_]{0,7}", fullmatch=True).filter(
    lambda s: not keyword.iskeyword(s) and s not in RESERVED and not s.startswith("fused")
)


def _indent(lines: list[str], by: int = 4) -> list[str]:
    return [" " * by + line if line else line for line in lines]


@st.composite
def gdn_sources(draw: st.DrawFn) -> str:
    """A module with one GDN-shaped spec path (see the module docstring)."""
    n = draw(st.lists(identifier, min_size=14, max_size=14, unique=True))
    qkv, a, b, md, idx, qs, q, k, v, out, slots, flag, tmp, alias = n
    method = draw(st.booleans())
    fast_path = draw(st.booleans())
    gather = draw(st.sampled_from(["method", "torch", "subscript", "mask"]))
    gates = draw(st.sampled_from(["raw", "raw", "gathered", "one", "non_spec", "inline"]))
    call_name = draw(st.sampled_from([KERNEL, "gdn_update", "ops.kernel", alias]))
    positional = draw(st.integers(0, 7))

    field = "spec_token_masks" if gather == "mask" else "spec_token_indx"
    select = {
        "method": f"{qkv}.index_select(0, {idx})",
        "torch": f"torch.index_select({qkv}, 0, {idx})",
        "subscript": f"{qkv}[{idx}]",
        "mask": f"{qkv}[{idx}]",
    }[gather]

    def gate_sel(g: str, index: str) -> str:
        return select.replace(qkv, g, 1).replace(idx, index)

    body = [f"{idx} = {md}.{field}", f"{slots} = {md}.spec_state_indices_tensor"]
    if call_name == alias:
        body.append(f"{alias} = {KERNEL}")
    gate_a, gate_b = a, b
    gathered = {"gathered": (a, b), "one": (b,), "non_spec": (a, b)}.get(gates, ())
    index_for_gates = f"{md}.non_spec_token_indx" if gates == "non_spec" else idx
    mixed = [f"{qs} = {select}"] + [f"{g}_rows = {gate_sel(g, index_for_gates)}" for g in gathered]
    if fast_path:
        fast = [f"{qs} = {qkv}"] + [f"{g}_rows = {g}" for g in gathered]
        test = f"{md}.num_prefills == 0 and {md}.num_decodes == 0"
        body += [f"if {test}:", *_indent(fast), "else:", *_indent(mixed)]
    else:
        body += mixed
    if a in gathered:
        gate_a = f"{a}_rows"
    if b in gathered:
        gate_b = f"{b}_rows"
    if gates == "inline":
        gate_a = gate_sel(a, idx)
    body.append(f"{q}, {k}, {v} = split({qs})")
    args = [
        ("A_log", "weights.A_log"),
        ("a", gate_a),
        ("b", gate_b),
        ("dt_bias", "weights.dt_bias"),
        ("q", q),
        ("k", k),
        ("v", v),
    ]
    keywords = [
        ("initial_state", "state"),
        ("ssm_state_indices", slots),
        ("num_accepted_tokens", f"{md}.num_accepted_tokens"),
    ]
    rest = draw(st.permutations(args[positional:] + keywords))
    parts = [value for _, value in args[:positional]] + [f"{p}={value}" for p, value in rest]
    sep = draw(st.sampled_from([", ", ",\n        ", ",  # note\n        "]))
    body.append(f"{out}, _ = {call_name}(")
    body.append("    " + sep.join(parts) + ",")
    body.append(")")
    body.append(f"return {out}")

    extras = [
        f"{tmp} = {qkv}.shape[0]",
        f"{a} = {a}.float()",
        f"if {flag}:\n    {qs} = {qs}.contiguous()",
        "# a comment line",
        "",
        f"{tmp} = [r for r in range(3)]",
        f"for _ in range(2):\n    {tmp} = {md}.num_decodes",
        f"with ctx():\n    {tmp} = 1",
        f"try:\n    {tmp} = 2\nexcept Exception:\n    raise",
        f"if {flag}:\n    return None",
        f"{idx} = {idx}.to({qkv}.device)",
        f"{b} = {b}[:{md}.num_actual_tokens]",
        f"{q}, {k} = {k}, {q}",
        f"match {flag}:\n    case 1:\n        {tmp} = {a}\n    case _:\n        pass",
        f"{tmp} = lambda x: x + ({qkv} if x else {a})",
        f"while {flag}:\n    break",
    ]
    for extra in draw(st.lists(st.sampled_from(extras), max_size=4)):
        at = draw(st.integers(0, len(body) - 1))
        lines = extra.split("\n")
        # Keep the indentation of the line it goes before.
        pad = len(body[at]) - len(body[at].lstrip())
        if body[at].lstrip().startswith(("else:", ")", "    ")) or pad != 0:
            continue
        body[at:at] = lines

    params = f"{qkv}, {b}, {a}, {md}"
    header = [
        f"from fla.ops import {KERNEL}",
        f"from fla.ops import {KERNEL} as gdn_update",
        "from fla import ops",
        "import torch",
        "",
        "",
    ]
    if method:
        func = [f"def forward(self, {params}, weights=None, state=None):", *_indent(body)]
        lines = [*header, "class Layer:", *_indent(func)]
    else:
        lines = [*header, f"def forward({params}, weights=None, state=None):", *_indent(body)]
    return "\n".join(lines).replace("ops.kernel(", f"ops.{KERNEL}(") + "\n"


@contextmanager
def tree_with(source: bytes) -> Iterator[tuple[Path, Path]]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        target = root / "vllm" / "layer.py"
        target.parent.mkdir()
        target.write_bytes(source)
        yield root, target


def _files(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and atomic.STATE_DIR not in p.parts
    }


@SETTINGS
@given(gdn_sources())
def test_revert_after_apply_gives_the_bytes_back(source: str) -> None:
    with tree_with(source.encode()) as (root, target):
        before = _files(root)
        try:
            out = apply_tree(root)
        except UsageError:
            assert _files(root) == before
            return
        if out.exit_code == 2 or not out.written:
            assert _files(root) == before
            return
        assert out.exit_code == 0 and target.read_bytes() != source.encode()
        revert_tree(root)
        assert _files(root) == before


@SETTINGS
@given(gdn_sources())
def test_apply_twice_is_apply_once(source: str) -> None:
    with tree_with(source.encode()) as (root, _):
        try:
            first = apply_tree(root)
        except UsageError:
            return
        once = _files(root)
        second = apply_tree(root)
        assert _files(root) == once
        assert not second.written and second.exit_code in (0, 2)
        if first.written:
            assert second.exit_code == 0
            assert all(c.status is not Status.AFFECTED for c in second.changes)


def _scan(text: str) -> None:
    """scan_text on ``text``: a list of sites, or UsageError; nothing else."""
    try:
        sites = scan_text("layer.py", text, load())
    except UsageError as exc:
        assert "\n" not in str(exc)
        return
    for site in sites:
        assert isinstance(site.status, Status) and site.reason


@SETTINGS
@given(gdn_sources())
def test_scan_never_raises_on_gdn_shaped_sources(source: str) -> None:
    _scan(source)


@SETTINGS
@given(gdn_sources(), st.data())
def test_scan_never_raises_on_cut_and_shuffled_sources(source: str, data: st.DataObject) -> None:
    lines = source.splitlines(keepends=True)
    how = data.draw(st.sampled_from(["drop", "shuffle", "cut", "dedent"]))
    if how == "drop":
        i = data.draw(st.integers(0, len(lines) - 1))
        lines = lines[:i] + lines[i + 1 :]
    elif how == "shuffle":
        lines = data.draw(st.permutations(lines))
    elif how == "cut":
        text = "".join(lines)
        lines = [text[: data.draw(st.integers(0, len(text)))]]
    else:
        lines = [line.lstrip(" ") for line in lines]
    _scan("".join(lines))


@SETTINGS
@given(st.text(max_size=400))
def test_scan_never_raises_on_random_text(text: str) -> None:
    # Mention the fields so the prefilter lets the text through.
    _scan(f"# spec_token_indx spec_state_indices_tensor\n{text}")
    _scan(f"def f(md):\n    x = md.spec_token_indx\n{text}")
