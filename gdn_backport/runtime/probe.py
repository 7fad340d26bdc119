"""Opt-in reachability probe: does this deployment's traffic trigger the bugs?

With ``GDN_BACKPORT_PROBE=1`` (and the ``gdn_backport`` general plugin
loaded), :func:`install_from_env` wraps
``vllm.v1.attention.backends.gdn_attn.GDNAttentionMetadataBuilder.build``.
Every build is counted, and each patchset's events
(``Patchset.probe_events()``: the batches where its bug is triggered, e.g.
spec rows behind a non-spec token) are counted per build.

Only host data is read: the ``int`` counts of the returned metadata and the
CPU tensors of ``common_attn_metadata`` and ``num_decode_draft_tokens_cpu``,
through ``Tensor.numpy()`` (:func:`host_list`), which refuses a device tensor
rather than copying it: a probe that touched one would fail (and be counted
as a probe error), never synchronise.

The wrapper returns the builder's own result, untouched, whatever the probe
does; the builder's exceptions pass through unchanged.

Nothing heavy is imported: not torch, not numpy (the tensors come in with
their own ``.numpy()``).
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import logging
import os
import sys
import threading
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gdn_backport.runtime import hook

__all__ = [
    "BUILDER_CLASS",
    "BUILDER_MODULE",
    "PROBE",
    "Probe",
    "ProbeCounts",
    "ProbeEvent",
    "ProbeSource",
    "events",
    "host_field",
    "host_list",
    "install_from_env",
    "sources",
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
# Host data (what every patchset's events read)
# --------------------------------------------------------------------------


def host_list(values: Any) -> list[int]:
    """A CPU tensor, numpy array or sequence as a list of ints. A torch tensor
    goes through ``.numpy()``, which refuses a device tensor instead of
    copying it to the host (``.tolist()`` would copy and synchronise)."""
    to_numpy = getattr(values, "numpy", None)
    if to_numpy is not None:
        values = to_numpy()
    tolist = getattr(values, "tolist", None)
    return list(tolist() if tolist is not None else values)


def host_field(metadata: Any, *names: str) -> list[int] | None:
    """The first of ``names`` the metadata holds as host data (its instance
    fields only: a property might compute from a device tensor)."""
    fields = getattr(metadata, "__dict__", {})
    for name in names:
        value = fields.get(name)
        if value is not None:
            return host_list(value)
    return None


# --------------------------------------------------------------------------
# Counting and reporting
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ProbeEvent:
    """One thing a patchset counts in builds: a counter and how the line shows it."""

    name: str  # the counter's name (JSON key)
    label: str  # how the line names it
    digits: int = 2  # per-mille precision in the line
    always: bool = True  # shown at zero too
    note: str = ""  # after the rate, e.g. the upstream PR


@dataclass(frozen=True)
class ProbeSource:
    """A patchset's part of the probe (``Patchset.probe()``): its events, and
    ``observe(builder, common_attn_metadata, num_decode_draft_tokens_cpu,
    result)``, which says from host data only which of them this build shows
    (raising makes the build a probe error)."""

    events: tuple[ProbeEvent, ...]
    observe: Callable[[Any, Any, Any, Any], dict[str, bool]]


def sources() -> tuple[ProbeSource, ...]:
    """Every patchset's probe part, in registry order."""
    from gdn_backport import registry

    return tuple(src for ps in registry.discover() if (src := ps.probe()) is not None)


def events() -> tuple[ProbeEvent, ...]:
    return tuple(e for src in sources() for e in src.events)


class ProbeCounts:
    """Builds, probe errors, and each event's count (``counts.mixed``)."""

    def __init__(self, builds: int = 0, errors: int = 0, **counts: int) -> None:
        self.builds = builds
        self.errors = errors
        known = [e.name for e in events()]
        unknown = sorted(set(counts) - set(known))
        if unknown:
            raise TypeError(f"no probe event {unknown[0]!r} (known: {', '.join(known)})")
        self.events = {name: counts.get(name, 0) for name in known}

    def __getattr__(self, name: str) -> int:
        events = self.__dict__.get("events", {})
        if name in events:
            return int(events[name])
        raise AttributeError(name)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ProbeCounts):
            return NotImplemented
        return (self.builds, self.errors, self.events) == (other.builds, other.errors, other.events)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in self.to_json().items())
        return f"ProbeCounts({inner})"

    def to_json(self) -> dict[str, int]:
        return {"builds": self.builds, **self.events, "errors": self.errors}

    def line(self, pid: int | None = None) -> str:
        """``gdn-backport probe: 123456 builds, 2345 mixed (19.0/1000), ...``."""

        def per_mille(n: int) -> float:
            return 1000.0 * n / self.builds if self.builds else 0.0

        parts = [f"{self.builds} builds"]
        for e in events():
            n = self.events[e.name]
            if n or e.always:
                note = f", {e.note}" if e.note else ""
                parts.append(f"{n} {e.label} ({per_mille(n):.{e.digits}f}/1000{note})")
        if self.errors:
            parts.append(f"{self.errors} probe errors")
        return f"gdn-backport probe: {', '.join(parts)} [pid {os.getpid() if pid is None else pid}]"


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
        self._builds = self._errors = 0
        self._events: dict[str, int] = {}
        self._error_logged = False
        self._final_done = False

    def counts(self) -> ProbeCounts:
        with self._lock:
            return ProbeCounts(self._builds, self._errors, **self._events)

    def record(self, seen: dict[str, bool]) -> None:
        """One build, and which events it showed."""
        with self._lock:
            self._builds += 1
            for name, hit in seen.items():
                self._events[name] = self._events.get(name, 0) + bool(hit)
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
            self._builds = self._errors = 0
            self._events = {}
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
        record = {"pid": os.getpid(), "time": time.time(), "final": final, **counts.to_json()}
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


def _observe(
    watched: Sequence[ProbeSource], builder: Any, metadata: Any, drafts: Any, result: Any
) -> dict[str, bool]:
    seen: dict[str, bool] = {}
    for src in watched:
        seen.update(src.observe(builder, metadata, drafts, result))
    return seen


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
    watched = sources()

    @functools.wraps(original)
    def build(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        try:
            metadata = _argument(args, kwargs, _METADATA_PARAM, i_metadata)
            drafts = _argument(args, kwargs, _DRAFTS_PARAM, i_drafts)
            seen = _observe(watched, self, metadata, drafts, result)
        except Exception as exc:
            counter.record_error(exc)
        else:
            counter.record(seen)
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


WATCH = "gdn-probe"  # the probe's post-import watch (see .hook)


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
