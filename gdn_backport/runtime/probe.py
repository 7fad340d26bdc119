"""Opt-in reachability probe: does this deployment's traffic trigger the bug?

With ``GDN_BACKPORT_PROBE=1`` (and the ``gdn_backport`` general plugin
loaded), :func:`install_from_env` wraps
``vllm.v1.attention.backends.gdn_attn.GDNAttentionMetadataBuilder.build``.
Every build is counted; a build is *mixed* when the builder took its gather
branch (spec rows and non-spec rows with tokens in one batch), and
*spec-not-prefix* when, in addition, some non-spec token comes before a spec
token, so the gathered ``spec_token_indx`` is not ``0..n-1``: exactly the
batches where an affected release hands the spec kernel other tokens' gates.

Only host data is read: the ``int`` counts of the returned metadata
(``num_spec_decodes``, ``num_prefills``, ``num_decodes``) and the CPU tensors
``common_attn_metadata.query_start_loc_cpu`` and
``num_decode_draft_tokens_cpu``, through ``Tensor.numpy()``, which refuses a
device tensor rather than copying it: a probe that touched one would fail
(and be counted as a probe error), never synchronise.

The wrapper returns the builder's own result, untouched, whatever the probe
does; the builder's exceptions pass through unchanged.

Nothing heavy is imported: not torch, not numpy (the tensors come in with
their own ``.numpy()``).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import inspect
import itertools
import json
import logging
import os
import sys
import threading
import time
import types
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from gdn_backport.runtime import hook

__all__ = [
    "BUILDER_CLASS",
    "BUILDER_MODULE",
    "PROBE",
    "Layout",
    "Probe",
    "ProbeCounts",
    "classify",
    "install_from_env",
    "uninstall",
    "unwrap_builder",
    "wrap_builder",
]

BUILDER_MODULE = "vllm.v1.attention.backends.gdn_attn"
BUILDER_CLASS = "GDNAttentionMetadataBuilder"
ENV_ON = "GDN_BACKPORT_PROBE"
ENV_EVERY = "GDN_BACKPORT_PROBE_EVERY"
ENV_FILE = "GDN_BACKPORT_PROBE_FILE"
DEFAULT_EVERY = 10_000

# Set on the wrapper function: makes wrapping idempotent and findable.
_MARKER = "__gdn_backport_probe__"
_METADATA_PARAM = "common_attn_metadata"
_DRAFTS_PARAM = "num_decode_draft_tokens_cpu"

logger = logging.getLogger("gdn_backport.probe")


# --------------------------------------------------------------------------
# Classification (host data only)
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """What one build's batch looks like to the GDN layer."""

    mixed: bool  # spec rows and non-spec tokens together: the gather branch
    spec_not_prefix: bool  # a non-spec token precedes a spec token
    # vLLM #51565: a row with no prior state (a new request's first chunk)
    # that the builder classified as a decode (it reads a recycled slot).
    new_row_decode: bool = False


_NOT_MIXED = Layout(mixed=False, spec_not_prefix=False)


def _host_field(metadata: Any, *names: str) -> list[int] | None:
    """The first of ``names`` the metadata holds as host data (its instance
    fields only: a property might compute from a device tensor)."""
    fields = getattr(metadata, "__dict__", {})
    for name in names:
        value = fields.get(name)
        if value is not None:
            return _host_list(value)
    return None


def new_row_decodes(metadata: Any, result: Any, drafts: Any) -> bool:
    """Whether the build classified a row without prior state as a decode.

    No prior state: ``seq_lens_cpu_upper_bound <= query_len`` (0.20 on), or
    no computed tokens (older fields), and still prefilling where the
    metadata says (``is_prefilling``, 0.19 on: capture dummies are not;
    before it they count too, at start-up only). Decodes: the first
    ``num_decodes`` rows without spec rows; beside spec rows the one-token
    non-spec rows where the builder still reports decodes (before 0.18)."""
    decodes = getattr(result, "num_decodes", None)
    spec = getattr(result, "num_spec_decodes", 0)
    if not isinstance(decodes, int) or decodes <= 0:
        return False
    starts = _host_list(metadata.query_start_loc_cpu)
    lens = [b - a for a, b in itertools.pairwise(starts)]
    upper = _host_field(metadata, "seq_lens_cpu_upper_bound")
    if upper is not None:
        fresh = [u <= q for u, q in zip(upper, lens, strict=False)]
    else:
        computed = _host_field(metadata, "num_computed_tokens_cpu", "_num_computed_tokens_cpu")
        if computed is None:
            return False  # a fork's metadata without these fields: not counted
        fresh = [c == 0 for c in computed]
    prefilling = _host_field(metadata, "is_prefilling")
    if prefilling is not None:
        fresh = [f and bool(p) for f, p in zip(fresh, prefilling, strict=False)]
    if isinstance(spec, int) and spec > 0:
        marks = _host_list(drafts) if drafts is not None else []
        rows = [i for i, d in enumerate(marks) if d < 0 and lens[i] == 1]
    else:
        rows = list(range(min(decodes, len(lens))))
    return any(lens[i] > 0 and fresh[i] for i in rows if i < len(fresh))


def _host_list(values: Any) -> list[int]:
    """A CPU tensor, numpy array or sequence as a list of ints. A torch tensor
    goes through ``.numpy()``, which refuses a device tensor instead of
    copying it to the host (``.tolist()`` would copy and synchronise)."""
    to_numpy = getattr(values, "numpy", None)
    if to_numpy is not None:
        values = to_numpy()
    tolist = getattr(values, "tolist", None)
    return list(tolist() if tolist is not None else values)


def classify(query_start_loc_cpu: Any, num_decode_draft_tokens_cpu: Any) -> Layout:
    """Classify a batch whose spec rows are ``num_decode_draft_tokens_cpu >= 0``.

    Mirrors the builder's gather branch: spec rows are those with a draft
    count ``>= 0``; non-spec rows without tokens (padding) do not count; the
    builder gathers spec tokens in row order (a stable argsort of the token
    mask), so ``spec_token_indx`` is ``0..n-1`` iff no non-spec token precedes
    a spec token. Accepts CPU tensors, numpy arrays or sequences; a device
    tensor raises instead of being read.
    """
    starts = _host_list(query_start_loc_cpu)
    drafts = _host_list(num_decode_draft_tokens_cpu)
    if len(starts) != len(drafts) + 1:
        raise ValueError(
            f"{len(starts) - 1} rows in query_start_loc_cpu, "
            f"{len(drafts)} in num_decode_draft_tokens_cpu"
        )
    # A plain loop: batches are at most a few hundred rows, and numpy's
    # per-call overhead would cost more than the loop (bench/bench_probe.py).
    any_spec = nonspec_seen = False
    for row, draft in enumerate(drafts):
        tokens = starts[row + 1] - starts[row]
        if draft >= 0:
            if nonspec_seen and tokens > 0:
                return Layout(mixed=True, spec_not_prefix=True)
            any_spec = True
        elif tokens > 0:
            nonspec_seen = True
    return Layout(mixed=any_spec and nonspec_seen, spec_not_prefix=False)


def _mixed_from_result(result: Any) -> bool | None:
    """Whether the version's own builder took its gather branch, from the
    returned metadata's ``int`` counts; None when it has no such counts (a
    fork's metadata class). The layer branches on the same counts."""
    spec = getattr(result, "num_spec_decodes", None)
    prefills = getattr(result, "num_prefills", None)
    decodes = getattr(result, "num_decodes", None)
    if isinstance(spec, int) and isinstance(prefills, int) and isinstance(decodes, int):
        return spec > 0 and prefills + decodes > 0
    return None


# --------------------------------------------------------------------------
# Counting and reporting
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ProbeCounts:
    builds: int = 0
    mixed: int = 0
    spec_not_prefix: int = 0
    errors: int = 0
    new_row_decodes: int = 0

    def line(self, pid: int | None = None) -> str:
        """``gdn-backport probe: 123456 builds, 2345 mixed (19.0/1000), ...``."""

        def per_mille(n: int) -> float:
            return 1000.0 * n / self.builds if self.builds else 0.0

        text = (
            f"gdn-backport probe: {self.builds} builds, "
            f"{self.mixed} mixed ({per_mille(self.mixed):.1f}/1000), "
            f"{self.spec_not_prefix} spec-not-prefix ({per_mille(self.spec_not_prefix):.2f}/1000)"
        )
        if self.new_row_decodes:
            text += (
                f", {self.new_row_decodes} new-row decodes "
                f"({per_mille(self.new_row_decodes):.2f}/1000, vLLM #51565)"
            )
        if self.errors:
            text += f", {self.errors} probe errors"
        return f"{text} [pid {os.getpid() if pid is None else pid}]"


class Probe:
    """Counters for one process; safe to share between threads.

    ``every``: log a line each time that many builds have been counted.
    ``json_path``: also append one JSON object per line logged (periodic and
    final), so several worker processes can be summed afterwards.
    """

    def __init__(self, every: int = DEFAULT_EVERY, json_path: str | None = None) -> None:
        self.every = every
        self.json_path = json_path
        self._lock = threading.Lock()
        self._builds = self._mixed = self._not_prefix = self._errors = 0
        self._new_rows = 0
        self._error_logged = False
        self._final_done = False

    def counts(self) -> ProbeCounts:
        with self._lock:
            return ProbeCounts(
                self._builds, self._mixed, self._not_prefix, self._errors, self._new_rows
            )

    def record(self, layout: Layout) -> None:
        with self._lock:
            self._builds += 1
            self._mixed += layout.mixed
            self._not_prefix += layout.spec_not_prefix
            self._new_rows += layout.new_row_decode
            due = self.every > 0 and self._builds % self.every == 0
        if due:
            self.report()

    def record_error(self, exc: BaseException) -> None:
        """A build whose classification failed: counted as a build and an error."""
        with self._lock:
            self._builds += 1
            self._errors += 1
            first = not self._error_logged
            self._error_logged = True
            due = self.every > 0 and self._builds % self.every == 0
        if first:
            logger.warning(
                "gdn-backport probe: cannot classify a build (%s: %s); counted as a probe "
                "error, the build itself is unaffected (logged once)",
                type(exc).__name__,
                exc,
            )
        if due:
            self.report()

    def reset(self) -> None:
        """Zero the counts (a forked child starts here)."""
        with self._lock:
            self._builds = self._mixed = self._not_prefix = self._errors = 0
            self._new_rows = 0
            self._error_logged = self._final_done = False

    def report(self, final: bool = False) -> None:
        counts = self.counts()
        logger.info("%s", counts.line())
        if self.json_path:
            self._append_json(counts, final)

    def report_at_exit(self) -> None:
        """The final line, once, and only when this process built anything."""
        with self._lock:
            if self._final_done or self._builds == 0:
                return
            self._final_done = True
        self.report(final=True)

    def _append_json(self, counts: ProbeCounts, final: bool) -> None:
        assert self.json_path is not None
        record = {"pid": os.getpid(), "time": time.time(), "final": final, **asdict(counts)}
        try:
            with open(self.json_path, "a", encoding="utf-8") as out:
                out.write(json.dumps(record) + "\n")
        except OSError as exc:
            logger.warning("gdn-backport probe: %s: cannot append: %s", self.json_path, exc)


PROBE = Probe()


# --------------------------------------------------------------------------
# Wrapping the builder
# --------------------------------------------------------------------------


def _param_index(fn: Callable[..., Any], name: str) -> int | None:
    """Position of ``name`` among ``fn``'s positional parameters (self included)."""
    params = list(inspect.signature(fn).parameters.values())
    for i, p in enumerate(params):
        if p.name == name:
            positional = p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            return i if positional else -1
    return None


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, index: int) -> Any:
    if name in kwargs:
        return kwargs[name]
    # ``index`` counts ``self``, which is not in ``args``.
    return args[index - 1] if 0 < index <= len(args) else None


def _observe(builder: Any, metadata: Any, drafts: Any, result: Any) -> Layout:
    layout = _observe_spec(builder, metadata, drafts, result)
    if new_row_decodes(metadata, result, drafts):
        return dataclasses.replace(layout, new_row_decode=True)
    return layout


def _observe_spec(builder: Any, metadata: Any, drafts: Any, result: Any) -> Layout:
    mixed = _mixed_from_result(result)
    if mixed is False:
        return _NOT_MIXED
    if mixed is None:
        # Without the builder's counts, its inputs decide as 0.18-0.31 do: no
        # spec rows unless spec decoding is on and some spec row drafted.
        if not getattr(builder, "use_spec_decode", True) or drafts is None:
            return _NOT_MIXED
        if sum(d for d in _host_list(drafts) if d >= 0) == 0:
            return _NOT_MIXED
    layout = classify(metadata.query_start_loc_cpu, drafts)
    if mixed and not layout.mixed:
        raise ValueError("the builder mixed spec and non-spec rows, the host tensors do not")
    return layout


def wrap_builder(builder_cls: type, probe: Probe | None = None) -> bool:
    """Wrap ``builder_cls.build`` with the probe, once.

    Returns True when ``build`` is probed after the call (wrapped now or
    before), False when it cannot be: no ``build``, or a signature without
    ``common_attn_metadata`` / ``num_decode_draft_tokens_cpu`` (then nothing
    is changed and a warning says why).
    """
    original = getattr(builder_cls, "build", None)
    if original is None or not callable(original):
        logger.warning("gdn-backport probe: %s has no build(); not probed", builder_cls)
        return False
    if getattr(original, _MARKER, False):
        return True
    i_metadata = _param_index(original, _METADATA_PARAM)
    i_drafts = _param_index(original, _DRAFTS_PARAM)
    if i_metadata is None or i_drafts is None:
        logger.warning(
            "gdn-backport probe: %s.build%s lacks %s or %s; not probed",
            builder_cls.__qualname__,
            inspect.signature(original),
            _METADATA_PARAM,
            _DRAFTS_PARAM,
        )
        return False
    counter = PROBE if probe is None else probe

    @functools.wraps(original)
    def build(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        try:
            metadata = _argument(args, kwargs, _METADATA_PARAM, i_metadata)
            drafts = _argument(args, kwargs, _DRAFTS_PARAM, i_drafts)
            layout = _observe(self, metadata, drafts, result)
        except Exception as exc:
            counter.record_error(exc)
        else:
            counter.record(layout)
        return result

    setattr(build, _MARKER, True)
    # The class's own entry, if any, is what unwrap_builder puts back.
    build.__gdn_backport_original__ = builder_cls.__dict__.get("build")  # type: ignore[attr-defined]
    builder_cls.build = build  # type: ignore[attr-defined]
    return True


def unwrap_builder(builder_cls: type) -> bool:
    """Undo :func:`wrap_builder`; True when something was unwrapped."""
    current = builder_cls.__dict__.get("build")
    if current is None or not getattr(current, _MARKER, False):
        return False
    original = current.__gdn_backport_original__
    if original is None:
        delattr(builder_cls, "build")  # it was inherited
    else:
        builder_cls.build = original  # type: ignore[attr-defined]
    return True


def _wrap_module(module: types.ModuleType) -> bool:
    builder_cls = getattr(module, BUILDER_CLASS, None)
    if not isinstance(builder_cls, type):
        logger.warning(
            "gdn-backport probe: %s has no class %s; not probed", module.__name__, BUILDER_CLASS
        )
        return False
    wrapped = wrap_builder(builder_cls)
    if wrapped:
        logger.info(
            "gdn-backport probe: counting %s.%s.build [pid %d]",
            module.__name__,
            BUILDER_CLASS,
            os.getpid(),
        )
    return wrapped


# --------------------------------------------------------------------------
# Finding the builder: now, or when vLLM imports its module
# --------------------------------------------------------------------------


WATCH = "pr51812-probe"  # the probe's post-import watch (see .hook)


def _on_builder_import(module: types.ModuleType) -> None:
    """Right after vLLM imported the builder's module: wrap, once."""
    hook.unwatch(WATCH)
    try:
        _wrap_module(module)
    except Exception as exc:  # the probe must never break vLLM's import
        logger.warning("gdn-backport probe: cannot wrap %s: %s", module.__name__, exc)


_exit_registered = False


def uninstall_hook() -> None:
    hook.unwatch(WATCH)


def _configure_logging() -> None:
    # vLLM configures only its own "vllm" loggers: without a handler on our
    # chain (the plugin's "gdn_backport", or the root), INFO lines would fall
    # through to logging's last resort, which shows WARNING and up only.
    if not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s"))
        logger.addHandler(handler)
    # A level set on the package logger (GDN_BACKPORT_LOG_LEVEL) is respected.
    if logger.level == logging.NOTSET and logging.getLogger("gdn_backport").level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def _register_exit() -> None:
    global _exit_registered
    if _exit_registered:
        return
    _exit_registered = True
    import multiprocessing.util

    atexit.register(PROBE.report_at_exit)
    # multiprocessing's children leave through os._exit (fork) or after
    # its own finalizers, so register there too; the fork child's registry
    # starts empty, hence the re-registration after each fork.
    multiprocessing.util.Finalize(None, PROBE.report_at_exit, exitpriority=0)
    multiprocessing.util.register_after_fork(PROBE, _after_fork_in_child)
    # A forked child counts its own builds, not its parent's.
    os.register_at_fork(after_in_child=PROBE.reset)


def _after_fork_in_child(probe: Probe) -> None:
    import multiprocessing.util

    multiprocessing.util.Finalize(None, probe.report_at_exit, exitpriority=0)


def install_from_env() -> None:
    """Turn the probe on in this process when ``GDN_BACKPORT_PROBE=1``.

    Reads ``GDN_BACKPORT_PROBE_EVERY`` (builds between log lines, default
    10000; 0 = only at exit) and ``GDN_BACKPORT_PROBE_FILE`` (append JSON
    lines there too). Wraps the builder now when its module is imported
    already, else when vLLM imports it (a ``sys.meta_path`` finder that wraps
    right after the module has run). Never raises: a problem is logged.
    """
    if os.environ.get(ENV_ON) != "1":
        return
    try:
        _configure_logging()
        every = os.environ.get(ENV_EVERY, "")
        try:
            PROBE.every = int(every) if every else DEFAULT_EVERY
        except ValueError:
            logger.warning(
                "gdn-backport probe: %s=%r is not an integer; using %d",
                ENV_EVERY,
                every,
                DEFAULT_EVERY,
            )
            PROBE.every = DEFAULT_EVERY
        PROBE.json_path = os.environ.get(ENV_FILE) or None
        _register_exit()
        module = sys.modules.get(BUILDER_MODULE)
        if module is not None:
            _wrap_module(module)
        elif not hook.watching(WATCH):
            hook.watch(WATCH, hook.Watch(names=BUILDER_MODULE.__eq__, callback=_on_builder_import))
    except Exception as exc:
        logger.warning("gdn-backport probe: not installed: %s: %s", type(exc).__name__, exc)


def uninstall() -> None:
    """Remove the import hook and unwrap the builder if its module is loaded."""
    uninstall_hook()
    module = sys.modules.get(BUILDER_MODULE)
    builder_cls = getattr(module, BUILDER_CLASS, None) if module is not None else None
    if isinstance(builder_cls, type):
        unwrap_builder(builder_cls)
