"""Request schedules as data: prompts (token ids, seeded), arrival, length.

A :class:`Request` arrives at driver step ``arrival``, or, with ``after``,
``arrival`` steps after the step in which request ``after`` finished (the
step right after a request finished is when its state slot is free to be
recycled). ``prefix_of``/``prefix_blocks`` make a prompt that starts with
the first ``prefix_blocks`` KV blocks of another request's prompt (the block
size is only known inside the engine, so the driver resolves it there;
``0``: all whole blocks of it); the request's own ``prompt`` is appended.
``role`` says what a scenario's rule does with the request (``stream``,
``background``, ``new``, ``prefix_hit``, ``source``).

The builders below are the workloads the scenarios use; they are pure
functions of their arguments and a seed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Request",
    "Workload",
    "misorder_rich",
    "one_token_arrivals",
    "pr_recipe",
    "prefix_hit",
    "production",
    "production_mixed",
    "prompt_tokens",
    "throughput",
]

ROLES = ("stream", "background", "new", "prefix_hit", "source")


@dataclass(frozen=True)
class Request:
    id: str
    prompt: tuple[int, ...]
    max_tokens: int
    arrival: int = 0
    after: str | None = None
    role: str = "stream"
    prefix_of: str | None = None
    prefix_blocks: int = 0

    def __post_init__(self) -> None:
        where = f"workload: request {self.id!r}"
        if self.max_tokens < 1:
            raise ValueError(f"{where}: max_tokens = {self.max_tokens}: expected >= 1")
        if self.arrival < 0:
            raise ValueError(f"{where}: arrival = {self.arrival}: expected >= 0")
        if self.role not in ROLES:
            raise ValueError(f"{where}: role = {self.role!r}: expected one of {', '.join(ROLES)}")
        if not self.prompt and not self.prefix_of:
            raise ValueError(f"{where}: prompt: empty")
        if self.prefix_blocks < 0:
            raise ValueError(f"{where}: prefix_blocks = {self.prefix_blocks}: expected >= 0")

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["prompt"] = list(self.prompt)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Request:
        values = dict(data)
        values["prompt"] = tuple(int(t) for t in values.get("prompt", ()))
        return cls(**values)


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[Request, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        ids = [r.id for r in self.requests]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"workload {self.name}: request {dupes[0]!r} appears twice")
        known = set(ids)
        for r in self.requests:
            for ref, key in ((r.after, "after"), (r.prefix_of, "prefix_of")):
                if ref is not None and ref not in known:
                    raise ValueError(
                        f"workload {self.name}: request {r.id!r}: {key} = {ref!r}: unknown"
                    )

    def by_role(self, *roles: str) -> list[Request]:
        return [r for r in self.requests if r.role in roles]

    def max_len(self) -> int:
        """The longest prompt + output any request can reach (prefix blocks
        not counted: resolved in the engine)."""
        return max((len(r.prompt) + r.max_tokens for r in self.requests), default=0)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "requests": [r.to_json() for r in self.requests]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Workload:
        return cls(str(data["name"]), tuple(Request.from_json(r) for r in data["requests"]))


def prompt_tokens(
    seed: int, key: str, length: int, token_range: tuple[int, int]
) -> tuple[int, ...]:
    """``length`` token ids in ``[low, high)``, a pure function of (seed, key)."""
    digest = hashlib.sha256(f"{seed}\0{key}".encode()).digest()
    rng = random.Random(int.from_bytes(digest[:8], "little"))
    low, high = token_range
    return tuple(rng.randrange(low, high) for _ in range(length))


def _requests(
    seed: int, vocab: tuple[int, int], specs: Iterable[dict[str, Any]]
) -> tuple[Request, ...]:
    out = []
    for spec in specs:
        values = dict(spec)
        length = values.pop("length")
        values["prompt"] = prompt_tokens(seed, values["id"], length, vocab)
        out.append(Request(**values))
    return tuple(out)


def pr_recipe(
    seed: int,
    vocab: tuple[int, int],
    lengths: Sequence[int] = (120, 64),
    max_tokens: int = 64,
) -> Workload:
    """vLLM #51812's reproduction: a few prompts at once, one of them so
    close to ``max_model_len`` that its last steps fit no draft: a one-token
    non-spec row sits before the other request's spec rows."""
    specs = [{"id": f"p{i}", "length": n, "max_tokens": max_tokens} for i, n in enumerate(lengths)]
    return Workload("pr-recipe", _requests(seed, vocab, specs))


def production(
    seed: int,
    vocab: tuple[int, int],
    streams: int = 8,
    shared_prefix: int = 320,
    gap: int = 3,
) -> Workload:
    """Concurrent streams sharing a system prompt (prefix-cache hits), of
    varied lengths, arriving every ``gap`` steps."""
    rng = random.Random(seed)
    prefix = prompt_tokens(seed, "system", shared_prefix, vocab)
    requests = []
    for i in range(streams):
        own = prompt_tokens(seed, f"s{i}", rng.randrange(8, 600), vocab)
        requests.append(
            Request(
                f"s{i}",
                prefix + own,
                max_tokens=rng.randrange(48, 128),
                arrival=i * gap,
            )
        )
    return Workload("production", tuple(requests))


def production_mixed(
    seed: int,
    vocab: tuple[int, int],
    max_model_len: int = 1280,
    streams: int = 6,
    shared_prefix: int = 320,
    gap: int = 3,
    pairs: int = 6,
    pair_start: int = 30,
    pair_gap: int = 10,
    prefix_blocks: int = 2,
    limit_streams: int = 8,
    limit_gap: int = 5,
) -> Workload:
    """The production shape (streams sharing a cached system prompt) with
    the two kinds of traffic that put a non-spec token before a spec row in
    vLLM 0.25.1 under prefix caching (mamba "align") and MTP drafts; the
    first design (:func:`production`) had neither and saw no misordered
    build on the H200.

    Follow-up pairs: after a source request that shares the system prompt
    has finished (its prefill cached the mamba state at ``prefix_blocks``
    whole blocks: its prompt is 1 to 2 blocks longer), two follow-ups repeat
    those blocks and add 2-3 tokens and 1 token. Both are admitted in one
    step while every running request decodes: the first runs as a 2-3 token
    chunk after its hit (no drafts); the second has one token left, which
    the scheduler pads to ``1 + k`` tokens with placeholder drafts ("Pad new
    decode requests to uniform spec decoding size", scheduler.py schedule())
    so it is a spec row, and the runner's reorder keeps both in the
    short-extend region in batch order: a spec row behind non-spec tokens.

    Conversations that run into the context limit: prompts ``24..48``
    tokens short of ``max_model_len``, unbounded outputs; the scheduler caps
    a request's tokens at ``max_model_len - computed - 1``, so its last step
    is one token without drafts, a decode row before the spec rows of the
    conversations that arrived after it.

    Phases do not overlap (a pair must find no running prefill chunk, or no
    pad happens): streams arrive first, then one pair every ``pair_gap``
    steps, then the long conversations."""
    rng = random.Random(seed)
    system = prompt_tokens(seed, "system", shared_prefix, vocab)
    out: list[Request] = []
    for i in range(streams):
        own = prompt_tokens(seed, f"s{i}", rng.randrange(8, 600), vocab)
        out.append(
            Request(f"s{i}", system + own, max_tokens=rng.randrange(120, 160), arrival=i * gap)
        )
    for j in range(pairs):
        # The source's prompt ends 1..2 blocks (0.25.1: 144 tokens) past the
        # shared prefix: its force-cached chunk then ends on that boundary.
        own = prompt_tokens(seed, f"src{j}", rng.randrange(113, 255), vocab)
        src = f"src{j}"
        out.append(
            Request(
                src, system + own, max_tokens=2, arrival=pair_start + j * pair_gap, role="source"
            )
        )
        for tail, name in ((rng.randrange(2, 4), f"fa{j}"), (1, f"fb{j}")):
            out.append(
                Request(
                    name,
                    prompt_tokens(seed, name, tail, vocab),
                    max_tokens=24,
                    after=src,
                    arrival=1,
                    prefix_of=src,
                    prefix_blocks=prefix_blocks,
                )
            )
    start = pair_start + pairs * pair_gap + 5
    for i in range(limit_streams):
        length = max_model_len - rng.randrange(24, 48) - shared_prefix
        own = prompt_tokens(seed, f"L{i}", length, vocab)
        out.append(
            Request(f"L{i}", system + own, max_tokens=max_model_len, arrival=start + i * limit_gap)
        )
    return Workload("production-mixed", tuple(out))


def misorder_rich(
    seed: int,
    vocab: tuple[int, int],
    max_model_len: int = 128,
    num_spec: int = 2,
    finishers: int = 24,
    gap: int = 2,
    decoders: int = 4,
    shorts: int = 8,
) -> Workload:
    """Many builds with a non-spec row before spec rows.

    In vLLM 0.25.1 the runner's reorder puts rows that have context, at most
    ``1 + num_spec`` tokens and a finished prompt first, *in their input
    batch order* (``reorder_batch_to_split_decodes_and_prefills``); a spec
    row is such a row, and so is a decode that could not get drafts: the
    scheduler caps a request's tokens at ``max_model_len - computed - 1``
    (scheduler.py, schedule()), so in its last step before the limit a
    request runs one token without drafts. Finished requests leave holes
    that ``condense`` fills with the last rows, so rows of all ages mix.
    Here requests whose prompts sit just below ``max_model_len`` arrive every
    ``gap`` steps and run to the limit while ``decoders`` long streams and
    short prompts of 2..1+num_spec tokens keep spec rows in the batch: almost
    every finishing request's last step is a misordered build.
    """
    rng = random.Random(seed)
    specs: list[dict[str, Any]] = []
    for i in range(decoders):
        length = rng.randrange(12, 32)
        specs.append({"id": f"d{i}", "length": length, "max_tokens": max_model_len, "arrival": 0})
    for i in range(finishers):
        length = max_model_len - rng.randrange(10, 26)
        specs.append(
            {"id": f"f{i}", "length": length, "max_tokens": max_model_len, "arrival": 1 + i * gap}
        )
    for i in range(shorts):
        length = rng.randrange(2, num_spec + 2)
        specs.append(
            {
                "id": f"t{i}",
                "length": length,
                "max_tokens": 24,
                "arrival": 3 + i * (finishers * gap // max(shorts, 1)),
            }
        )
    return Workload("misorder-rich", _requests(seed, vocab, specs))


def one_token_arrivals(
    seed: int,
    vocab: tuple[int, int],
    others: int = 4,
    background: int = 4,
    new: int = 4,
    second_wave: int = 2,
) -> Workload:
    """vLLM #51565's case: brand-new one-token prompts arriving while other
    requests decode, in the step right after ``background`` requests
    finished, so their state slots are recycled with non-zero state
    (without prefix caching a freed block goes to the head of the free
    queue: block_pool.py, free_blocks). Background requests sit between the
    others in the batch, so their rows leave holes that ``condense`` fills:
    stale FULL-graph buffers then point the other rows at wrong slots. A
    second wave arrives after the first new requests finish."""
    rng = random.Random(seed)
    specs: list[dict[str, Any]] = []
    for i in range(max(others, background)):
        if i < others:
            specs.append({"id": f"o{i}", "length": rng.randrange(24, 48), "max_tokens": 40})
        if i < background:
            specs.append(
                {
                    "id": f"b{i}",
                    "length": rng.randrange(16, 40),
                    "max_tokens": 6,
                    "role": "background",
                }
            )
    last = f"b{background - 1}"
    for i in range(new):
        specs.append(
            {
                "id": f"n{i}",
                "length": 1,
                "max_tokens": 8 if i == 0 else 24,
                "after": last,
                "arrival": 1,
                "role": "new",
            }
        )
    for i in range(second_wave):
        specs.append(
            {
                "id": f"w{i}",
                "length": 1,
                "max_tokens": 16,
                "after": "n0",
                "arrival": 1,
                "role": "new",
            }
        )
    return Workload("one-token-arrivals", _requests(seed, vocab, specs))


def prefix_hit(seed: int, vocab: tuple[int, int], others: int = 3) -> Workload:
    """A prefix-cache hit that leaves exactly one new token: ``hit`` repeats
    every whole KV block of ``src``'s prompt plus one token, arriving after
    ``src`` finished, while other requests decode. With mamba cache mode
    "align" the scheduler ends a prefill chunk on a block boundary
    (``_mamba_block_aligned_split``), so the state at the last whole block is
    the one cached: a shorter prefix would find no cached state."""
    specs: list[dict[str, Any]] = [
        {"id": "src", "length": 600, "max_tokens": 4, "role": "source"},
    ]
    specs += [{"id": f"o{i}", "length": 20 + 7 * i, "max_tokens": 48} for i in range(others)]
    out = list(_requests(seed, vocab, specs))
    out.append(
        Request(
            "hit",
            prompt_tokens(seed, "hit", 1, vocab),
            max_tokens=24,
            after="src",
            arrival=1,
            role="prefix_hit",
            prefix_of="src",
            prefix_blocks=0,
        )
    )
    return Workload("prefix-hit", tuple(out))


def throughput(
    seed: int, vocab: tuple[int, int], batch: int, prompt_len: int, max_tokens: int
) -> Workload:
    """``batch`` requests of one length, all at step 0 (decode throughput)."""
    specs = [{"id": f"q{i}", "length": prompt_len, "max_tokens": max_tokens} for i in range(batch)]
    return Workload(f"throughput-{batch}", _requests(seed, vocab, specs))
