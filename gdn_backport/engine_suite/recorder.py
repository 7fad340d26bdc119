"""What the engine did, step by step: every GDN metadata build, attributed.

Installed in the engine process before the LLM is built (the engine core
runs in process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), it wraps

* ``GPUModelRunner.execute_model`` (vLLM 0.25.1: v1/worker/gpu_model_runner.py):
  the step entry; it holds the runner in a thread-local while the step runs
  and records the scheduler output (tokens and drafts per request, new and
  finished requests, which KV blocks a new request got and who had them
  before: a recycled state slot);
* ``GPUModelRunner._determine_batch_execution_and_padding``: the CUDA-graph
  mode the runner dispatches the step with (FULL replays the persistent
  decode buffers whatever the metadata says);
* ``GDNAttentionMetadataBuilder.build`` (v1/attention/backends/gdn_attn.py):
  one record per build, with the row order of ``runner.input_batch.req_ids``
  at build time (the batch is reordered before the builds), read from host
  tensors only;
* ``build_for_cudagraph_capture``: capture dummies are counted, not recorded.

Builds outside a real step (profiling, warm-up, capture) are counted
separately. Every wrapper returns the wrapped method's own result; a failure
of the recorder is noted, never raised into vLLM.

A build is *mixed* (spec rows and non-spec tokens) and *misordered* (a
non-spec token before a spec row: ``spec_token_indx`` not ``0..n-1``), as
the reachability probe counts them; the recorder adds which spec requests
were displaced (non-spec tokens before their rows: the gate-row shift an
affected spec kernel suffers), the one-token first chunks
of new requests (no computed tokens) and how the builder classified them,
and whether the builder filled the FULL-graph persistent buffers.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import itertools
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gdn_backport.runtime.probe import BUILDER_CLASS, BUILDER_MODULE

__all__ = [
    "RUNNER_CLASS",
    "RUNNER_MODULE",
    "BuildRecord",
    "Recorder",
    "StepRecord",
    "describe_build",
    "install",
]

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
RUNNER_CLASS = "GPUModelRunner"
_MARK = "__gdn_backport_recorder__"


def host_ints(values: Any) -> list[int]:
    """A CPU tensor, numpy array or sequence as ints. ``Tensor.numpy()``
    refuses a device tensor instead of copying (and synchronising)."""
    to_numpy = getattr(values, "numpy", None)
    if to_numpy is not None:
        values = to_numpy()
    tolist = getattr(values, "tolist", None)
    return [int(v) for v in (tolist() if tolist is not None else values)]


@dataclass
class BuildRecord:
    """One GDN metadata build inside a real engine step."""

    step: int
    group: int  # the build's index within its step (one per GDN KV-cache group)
    req_ids: list[str | None]  # per row; None for padding rows
    query_lens: list[int]
    drafts: list[int] | None  # num_decode_draft_tokens_cpu; >= 0: a spec row
    computed: list[int] | None  # tokens computed before this step, per row
    row_class: list[str]  # spec / decode / prefill / pad, as the builder counted
    num_spec_decodes: int | None
    num_decodes: int | None
    num_prefills: int | None
    mixed: bool
    misordered: bool  # spec_token_indx is not 0..n-1 (a non-spec token leads)
    displaced: dict[str, int]  # spec request -> non-spec tokens before its row
    new_rows: dict[str, str]  # one-token first chunk, nothing computed -> class
    full_buffers: bool | None  # the builder filled the FULL-graph decode buffers
    dispatch: str | None = None  # the step's CUDA-graph runtime mode

    @property
    def stale_replay(self) -> bool:
        """A FULL replay whose GDN buffers this build did not fill."""
        return self.dispatch == "FULL" and self.full_buffers is False

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["num_reqs"] = len(self.query_lens)
        data["stale_replay"] = self.stale_replay
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BuildRecord:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class StepRecord:
    """What the scheduler handed the runner in one real step."""

    step: int
    scheduled: dict[str, int]
    spec: dict[str, int]  # request -> drafts scheduled
    new: list[str]
    finished: list[str]  # finished since the previous step (removed now)
    recycled: dict[str, list[list[Any]]]  # new request -> [[group, previous owner]]
    uniform_shape: bool  # every row has the uniform decode length
    dispatch: str | None = None
    builds: int = 0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StepRecord:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def _row_classes(
    lens: Sequence[int], spec_rows: set[int], decodes: int | None, has_spec: bool
) -> list[str]:
    """Each row as the 0.25.1 builder counts it: without spec rows the first
    ``num_decodes`` rows are decodes (split by query length); beside spec
    rows non-spec one-token rows are decodes only where it still reports
    decodes (it reclassifies them as prefills)."""
    out = []
    seen_decodes = 0
    for row, q in enumerate(lens):
        if row in spec_rows:
            out.append("spec")
        elif q == 0:
            out.append("pad")
        elif not has_spec and decodes is not None and row < decodes:
            out.append("decode")
        elif has_spec and q == 1 and decodes and seen_decodes < decodes:
            seen_decodes += 1
            out.append("decode")
        else:
            out.append("prefill")
    return out


def describe_build(
    *,
    step: int,
    group: int,
    query_start_loc: Sequence[int],
    drafts: Sequence[int] | None,
    counts: tuple[int | None, int | None, int | None],
    req_ids: Sequence[str],
    computed: Sequence[int] | None,
    full_graph: tuple[bool, int] | None = None,
    dispatch: str | None = None,
) -> BuildRecord:
    """A :class:`BuildRecord` from host data only.

    ``counts``: the returned metadata's (num_spec_decodes, num_decodes,
    num_prefills). ``req_ids``/``computed``: the runner's real rows at build
    time (rows past them are padding). ``full_graph``: the builder's
    (use_full_cuda_graph, decode_cudagraph_max_bs)."""
    spec, decodes, prefills = counts
    lens = [b - a for a, b in itertools.pairwise(query_start_loc)]
    has_spec = bool(spec) and drafts is not None
    spec_rows = {i for i, d in enumerate(drafts or ()) if d >= 0} if has_spec else set()
    rows = [req_ids[i] if i < len(req_ids) else None for i in range(len(lens))]
    classes = _row_classes(lens, spec_rows, decodes, has_spec)

    mixed = misordered = False
    displaced: dict[str, int] = {}
    if has_spec and drafts is not None:
        # The builder gathers spec tokens in row order: spec_token_indx is
        # 0..n-1 unless a non-spec token comes first (the probe's rule).
        before = 0
        for row, q in enumerate(lens):
            if row in spec_rows:
                misordered = misordered or bool(before and q)
                if before and q and rows[row] is not None:
                    displaced[str(rows[row])] = before
            else:
                before += q
        mixed = bool(spec_rows) and any(q for i, q in enumerate(lens) if i not in spec_rows)

    new_rows: dict[str, str] = {}
    if computed is not None:
        for row, rid in enumerate(rows):
            if rid is not None and row < len(computed) and computed[row] == 0 and lens[row] == 1:
                new_rows[rid] = classes[row]

    full_buffers: bool | None = None
    if full_graph is not None and None not in counts:
        use_full, max_bs = full_graph
        spec_tokens = sum(lens[i] for i in spec_rows)
        assert spec is not None and decodes is not None and prefills is not None
        spec_branch = (
            prefills == 0 and decodes == 0 and 0 < spec <= max_bs and spec_tokens <= max_bs
        )
        decode_branch = prefills == 0 and spec == 0 and decodes <= max_bs
        full_buffers = bool(use_full) and (spec_branch or decode_branch)

    return BuildRecord(
        step=step,
        group=group,
        req_ids=rows,
        query_lens=lens,
        drafts=list(drafts) if drafts is not None else None,
        computed=list(computed[: len(lens)]) if computed is not None else None,
        row_class=classes,
        num_spec_decodes=spec,
        num_decodes=decodes,
        num_prefills=prefills,
        mixed=mixed,
        misordered=misordered,
        displaced=displaced,
        new_rows=new_rows,
        full_buffers=full_buffers,
        dispatch=dispatch,
    )


def _mode_name(mode: Any) -> str | None:
    name = getattr(mode, "name", None)
    return str(name) if name is not None else (str(mode) if mode is not None else None)


class _Context(threading.local):
    runner: Any = None
    step: StepRecord | None = None
    capture: bool = False
    tokens: int | None = None


@dataclass
class Recorder:
    """The records of one engine process. The driver sets :attr:`step`
    before each ``LLMEngine.step()``."""

    step: int | None = None
    # Off: only the first-step callbacks run (throughput runs record nothing).
    enabled: bool = True
    builds: list[BuildRecord] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    other_builds: dict[str, int] = field(default_factory=lambda: {"capture": 0, "other": 0})
    errors: list[str] = field(default_factory=list)
    group_kinds: list[str] = field(default_factory=list)
    runner_class: str | None = None
    on_first_step: list[Callable[[Any], None]] = field(default_factory=list)
    # The first CUDA-graph mode dispatched in the latest step (the target
    # model's; a drafter's forward may dispatch again).
    step_dispatch: str | None = None

    def __post_init__(self) -> None:
        self._ctx = _Context()
        # Block id -> the request that had it last. One pool serves every
        # KV-cache group and the groups' layers share memory by block id, so
        # a block is recycled whichever group it served before.
        self._owners: dict[int, str] = {}
        self._started = False

    # -- what the gate meter asks -------------------------------------------

    def tokens(self) -> int | None:
        """Real tokens of the running step's forward; None outside steps."""
        return self._ctx.tokens if self._ctx.step is not None else None

    # -- called by the wrappers ---------------------------------------------

    def note_error(self, where: str, exc: BaseException) -> None:
        if len(self.errors) < 20:
            self.errors.append(f"{where}: {type(exc).__name__}: {exc}")

    def enter_step(self, runner: Any, scheduler_output: Any) -> None:
        self._ctx.runner = runner
        self.step_dispatch = None
        self._ctx.tokens = None
        if not self._started:
            self._started = True
            self._first_step(runner)
        if self.step is None or not self.enabled:
            self._ctx.step = None
            return
        record = self._step_record(runner, scheduler_output)
        self.steps.append(record)
        self._ctx.step = record

    def exit_step(self) -> None:
        self._ctx.runner = None
        self._ctx.step = None
        self._ctx.tokens = None

    def on_dispatch(self, result: Any) -> None:
        if not (isinstance(result, tuple) and result):
            return
        mode = _mode_name(result[0])
        # Kept with recording off too: throughput runs time each step by the
        # CUDA-graph mode it ran with (a lost FULL replay shows as PIECEWISE).
        if self.step_dispatch is None:
            self.step_dispatch = mode
        record = self._ctx.step
        if record is not None:
            record.dispatch = mode

    def on_build(self, builder: Any, arguments: Mapping[str, Any], result: Any) -> None:
        if not self.enabled:
            return
        record = self._ctx.step
        if record is None:
            self.other_builds["capture" if self._ctx.capture else "other"] += 1
            return
        metadata = arguments["common_attn_metadata"]
        drafts = arguments.get("num_decode_draft_tokens_cpu")
        runner = self._ctx.runner
        batch = getattr(runner, "input_batch", None)
        n = int(getattr(batch, "num_reqs", 0) or 0)
        req_ids = [str(r) for r in list(getattr(batch, "req_ids", []))[:n]]
        computed_src = getattr(batch, "num_computed_tokens_cpu", None)
        computed = host_ints(computed_src)[:n] if computed_src is not None else None
        use_full = getattr(builder, "use_full_cuda_graph", None)
        max_bs = getattr(builder, "decode_cudagraph_max_bs", None)
        counts = tuple(
            v if isinstance(v, int) else None
            for v in (
                getattr(result, "num_spec_decodes", None),
                getattr(result, "num_decodes", None),
                getattr(result, "num_prefills", None),
            )
        )
        build = describe_build(
            step=record.step,
            group=record.builds,
            query_start_loc=host_ints(metadata.query_start_loc_cpu),
            drafts=host_ints(drafts) if drafts is not None else None,
            counts=(counts[0], counts[1], counts[2]),
            req_ids=req_ids,
            computed=computed,
            full_graph=(bool(use_full), int(max_bs)) if use_full is not None and max_bs else None,
            dispatch=record.dispatch,
        )
        record.builds += 1
        self._ctx.tokens = sum(build.query_lens)
        self.builds.append(build)

    # -- helpers ------------------------------------------------------------

    def _first_step(self, runner: Any) -> None:
        groups = getattr(getattr(runner, "kv_cache_config", None), "kv_cache_groups", None) or []
        self.group_kinds = [type(getattr(g, "kv_cache_spec", None)).__name__ for g in groups]
        self.runner_class = f"{type(runner).__module__}.{type(runner).__qualname__}"
        for callback in self.on_first_step:
            try:
                callback(runner)
            except Exception as exc:
                self.note_error("first step", exc)

    def _step_record(self, runner: Any, out: Any) -> StepRecord:
        scheduled = {
            str(k): int(v) for k, v in dict(getattr(out, "num_scheduled_tokens", {})).items()
        }
        spec = {
            str(k): len(v)
            for k, v in dict(getattr(out, "scheduled_spec_decode_tokens", {})).items()
        }
        new_reqs = list(getattr(out, "scheduled_new_reqs", []) or [])
        recycled: dict[str, list[list[Any]]] = {}
        for new in new_reqs:
            rid = str(new.req_id)
            for group, blocks in enumerate(getattr(new, "block_ids", ()) or ()):
                for block in blocks:
                    previous = self._owners.get(block)
                    if previous is not None and previous != rid:
                        pair = [group, previous]
                        if pair not in recycled.setdefault(rid, []):
                            recycled[rid].append(pair)
                    self._owners[block] = rid
        cached = getattr(out, "scheduled_cached_reqs", None)
        for rid, new_blocks in zip(
            getattr(cached, "req_ids", []) or [],
            getattr(cached, "new_block_ids", []) or [],
            strict=False,
        ):
            for blocks in new_blocks or ():
                for block in blocks:
                    self._owners[block] = str(rid)
        width = getattr(runner, "uniform_decode_query_len", None)
        uniform = (
            bool(scheduled) and width is not None and all(v == width for v in scheduled.values())
        )
        return StepRecord(
            step=int(self.step or 0),
            scheduled=scheduled,
            spec=spec,
            new=[str(n.req_id) for n in new_reqs],
            finished=sorted(str(r) for r in getattr(out, "finished_req_ids", ()) or ()),
            recycled=recycled,
            uniform_shape=uniform,
        )

    def to_json(self, names: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The records, request ids renamed by ``names``: vLLM 0.25.1 adds
        a random suffix to every request id it is given
        (``InputProcessor.assign_request_id``) and the runner sees only
        those; ``add_request`` returns them, the driver maps them back."""
        rename = _Renamer(names or {})
        builds = []
        for b in self.builds:
            data = b.to_json()
            data["req_ids"] = [rename(r) for r in b.req_ids]
            data["displaced"] = rename.keys(b.displaced)
            data["new_rows"] = rename.keys(b.new_rows)
            builds.append(data)
        steps = []
        for st in self.steps:
            data = st.to_json()
            data["scheduled"] = rename.keys(st.scheduled)
            data["spec"] = rename.keys(st.spec)
            data["new"] = [rename(r) for r in st.new]
            data["finished"] = sorted(rename(r) or "" for r in st.finished)
            data["recycled"] = {
                rename(k) or k: [[g, rename(prev)] for g, prev in pairs]
                for k, pairs in st.recycled.items()
            }
            steps.append(data)
        return {
            "builds": builds,
            "steps": steps,
            "other_builds": dict(self.other_builds),
            "errors": list(self.errors),
            "group_kinds": list(self.group_kinds),
            "runner": self.runner_class,
        }


class _Renamer:
    def __init__(self, names: Mapping[str, str]) -> None:
        self.names = names

    def __call__(self, rid: str | None) -> str | None:
        return None if rid is None else self.names.get(rid, rid)

    def keys(self, data: Mapping[str, Any]) -> dict[str, Any]:
        return {self.names.get(k, k): v for k, v in data.items()}


# --------------------------------------------------------------------------
# Installing the wrappers
# --------------------------------------------------------------------------


def _wrap(
    owner: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Callable[[], None]:
    own = owner.__dict__.get(name)
    original = getattr(owner, name)
    # functools.wraps without __dict__: the probe marks its own wrapper with
    # an attribute, and a copy of it on ours would make the probe think
    # ours is its own.
    wrapper = functools.wraps(original, updated=())(make(original))
    setattr(wrapper, _MARK, True)
    setattr(owner, name, wrapper)

    def undo() -> None:
        if own is None:
            delattr(owner, name)
        else:
            setattr(owner, name, own)

    return undo


def install(
    recorder: Recorder, builder_cls: type | None = None, runner_cls: type | None = None
) -> Callable[[], None]:
    """Wrap the builder's and the runner's methods (vLLM's own classes by
    default, imported here); returns an undo."""
    if builder_cls is None:
        builder_cls = getattr(importlib.import_module(BUILDER_MODULE), BUILDER_CLASS)
    if runner_cls is None:
        runner_cls = getattr(importlib.import_module(RUNNER_MODULE), RUNNER_CLASS)
    assert builder_cls is not None and runner_cls is not None
    ctx = recorder._ctx
    undos: list[Callable[[], None]] = []

    def build(original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            try:
                bound = signature.bind(self, *args, **kwargs)
                recorder.on_build(self, bound.arguments, result)
            except Exception as exc:
                recorder.note_error("build", exc)
            return result

        return wrapper

    def capture(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            ctx.capture = True
            try:
                return original(self, *args, **kwargs)
            finally:
                ctx.capture = False

        return wrapper

    def step(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                recorder.enter_step(self, scheduler_output)
            except Exception as exc:
                recorder.note_error("step", exc)
            try:
                return original(self, scheduler_output, *args, **kwargs)
            finally:
                recorder.exit_step()

        return wrapper

    def dispatch(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            try:
                recorder.on_dispatch(result)
            except Exception as exc:
                recorder.note_error("dispatch", exc)
            return result

        return wrapper

    undos.append(_wrap(builder_cls, "build", build))
    if hasattr(builder_cls, "build_for_cudagraph_capture"):
        undos.append(_wrap(builder_cls, "build_for_cudagraph_capture", capture))
    undos.append(_wrap(runner_cls, "execute_model", step))
    if hasattr(runner_cls, "_determine_batch_execution_and_padding"):
        undos.append(_wrap(runner_cls, "_determine_batch_execution_and_padding", dispatch))

    def undo() -> None:
        for u in reversed(undos):
            u()

    return undo
