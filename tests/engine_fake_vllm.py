"""A fake vLLM for the engine suite's CPU tests: ``make_site(tmp)`` writes a
``vllm`` package to put on a child's PYTHONPATH.

It has the seams the suite's driver and recorder use, shaped like vLLM
0.25.1's but written here: ``vllm.LLM`` / ``llm_engine`` (``add_request``,
``step``, ``has_unfinished_requests``, ``generate`` with prompt logprobs),
``SamplingParams``, ``GDNAttentionMetadataBuilder.build`` (and
``build_for_cudagraph_capture``), ``GPUModelRunner.execute_model`` /
``_determine_batch_execution_and_padding`` with an ``input_batch``,
``DummyModelLoader`` and a model registry file.

The engine is deterministic and tiny: every scheduled request makes one token
per step (drafts are always rejected). Its scheduler stops drafting for a
request whose next step would pass ``max_model_len`` (a one-token non-spec
row) and orders rows as 0.25.1's reorder does (rows with context and at most
1 + k tokens first, in batch order; then first chunks), so misordered builds
arise exactly as there. Run logprobs are ``base(token, position)``; the
reference (prompt logprobs) adds a small noise: that is the floor. Bugs, by
environment variable in the child:

``FAKE_VLLM_GATES=ungathered``
    a spec request displaced in a build errs by 0.05 from then on;
``FAKE_VLLM_NEW_ROW=bug|half|fixed`` (default fixed)
    bug: a one-token first chunk in a non-spec batch is a decode and, on a
    recycled block, errs by 0.3 with other tokens; half: the builder calls it
    a prefill but a FULL replay (graphs, uniform batch) reads stale buffers:
    the new row errs, the others err by 0.05 (collateral);
``FAKE_VLLM_FLAT_GATES=1``: the GDN layers see constant gate inputs;
``FAKE_VLLM_CRASH=1``: the LLM constructor raises; ``FAKE_VLLM_HANG=1``:
    it sleeps for a minute.
"""

from __future__ import annotations

from pathlib import Path

ENGINE = r"""
import os
import time


class SamplingParams:
    def __init__(self, max_tokens=16, temperature=1.0, logprobs=None, prompt_logprobs=None,
                 detokenize=True, ignore_eos=False, **kw):
        self.max_tokens = max_tokens
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs


class Logprob:
    def __init__(self, logprob):
        self.logprob = logprob


class CompletionOutput:
    def __init__(self, token_ids, logprobs, finish_reason):
        self.token_ids = token_ids
        self.logprobs = logprobs
        self.finish_reason = finish_reason


class RequestOutput:
    def __init__(self, request_id, outputs, finished, prompt_logprobs=None):
        self.request_id = request_id
        self.outputs = outputs
        self.finished = finished
        self.prompt_logprobs = prompt_logprobs


def token_at(prompt, position):
    return (sum(prompt) * 31 + position * 17) % 4000 + 16


def base_lp(token, position):
    return -((token % 97) / 97.0) - 0.5


def noise(token, position):
    return (((token * 7 + position * 13) % 11) - 5) * 1e-4


class _Req:
    def __init__(self, rid, prompt, params):
        self.id = rid
        self.prompt = list(prompt)
        self.params = params
        self.tokens = []
        self.lps = []
        self.computed = 0
        self.error = 0.0
        self.shift = 0
        self.blocks = None
        self.finished = False


class _Obj:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Engine:
    def __init__(self, llm):
        self.llm = llm
        self.vllm_config = _Obj(cache_config=_Obj(block_size=16),
                                compilation_config=_Obj(cudagraph_mode="FAKE"))
        self.order = []      # the input batch order (add order, holes filled)
        self.reqs = {}
        self.finished_ids = []
        self.free = []       # freed blocks: reused first (LIFO), as without prefix caching
        self.next_block = 1
        self.owner = {}

    def add_request(self, rid, prompt, params):
        # As vLLM does: the engine's own id has a random suffix.
        internal = f"{rid}-{len(self.reqs):08x}"
        self.reqs[internal] = _Req(rid, prompt["prompt_token_ids"], params)
        self.order.append(internal)
        return internal

    def has_unfinished_requests(self):
        return any(not r.finished for r in self.reqs.values())

    def _block(self, rid):
        block = self.free.pop() if self.free else self.next_block
        if block == self.next_block:
            self.next_block += 1
        recycled = block in self.owner
        self.owner[block] = rid
        return block, recycled

    def step(self):
        llm = self.llm
        k, limit = llm.num_spec, llm.max_model_len
        live = [rid for rid in self.order if not self.reqs[rid].finished]
        if not live:
            return []
        new, recycled = [], {}
        scheduled, drafts = {}, {}
        for rid in live:
            r = self.reqs[rid]
            if r.blocks is None:
                block, was = self._block(rid)
                r.blocks = ([block],)
                r.recycled = was
                new.append(_Obj(req_id=rid, block_ids=r.blocks, num_computed_tokens=0))
            if r.computed == 0:
                scheduled[rid] = len(r.prompt)
            elif k and r.computed + 1 + k <= limit - 1:
                scheduled[rid], drafts[rid] = 1 + k, k
            else:
                scheduled[rid] = 1
        # 0.25.1's reorder: rows with context and <= 1 + k tokens first, in
        # batch order; first chunks last.
        decode = [rid for rid in live if self.reqs[rid].computed > 0]
        first = [rid for rid in live if self.reqs[rid].computed == 0]
        rows = decode + first
        out = _Obj(num_scheduled_tokens=scheduled,
                   scheduled_spec_decode_tokens={rid: [0] * n for rid, n in drafts.items()},
                   scheduled_new_reqs=new, finished_req_ids=set(self.finished_ids),
                   scheduled_cached_reqs=_Obj(req_ids=[], new_block_ids=[]))
        self.finished_ids = []
        llm.runner.rows = rows
        llm.runner.engine = self
        llm.runner.execute_model(out)
        results = []
        for rid in rows:
            r = self.reqs[rid]
            position = len(r.prompt) + len(r.tokens)
            token = token_at(r.prompt, position) + r.shift
            r.tokens.append(token)
            r.lps.append(base_lp(token, position) + r.error)
            r.computed = position
            done = len(r.tokens) >= r.params.max_tokens or position + 1 >= limit
            if done:
                r.finished = True
                self.finished_ids.append(rid)
                self.free.extend(r.blocks[0])
            lps = [{t: Logprob(lp)} for t, lp in zip(r.tokens, r.lps)]
            results.append(RequestOutput(r.id, [CompletionOutput(list(r.tokens), lps,
                                          "length" if done else None)], done))
        self.order = [rid for rid in self.order if not self.reqs[rid].finished]
        return results


class _Engine025(_Engine):
    # 0.25.1's scheduler and persistent batch, as far as the row order of a
    # spec-decode step depends on them (v1/core/sched/scheduler.py schedule(),
    # _mamba_block_aligned_split; the hybrid prefix-cache hit;
    # v1/worker/gpu_input_batch.py add/condense;
    # reorder_batch_to_split_decodes_and_prefills). Drafts are always
    # rejected: a decode row makes one token a step.

    def __init__(self, llm):
        super().__init__(llm)
        # The block size 0.25.1 chose for the tiny model with mamba "align"
        # (attention pages sized to the mamba state), as the H200 run reported.
        self.bs = 144 if llm.align else 16
        self.vllm_config.cache_config.block_size = self.bs
        self.waiting = []
        self.running = []
        self.batch = []      # input batch rows: request id or None (a hole)
        self.states = set()  # prompt prefixes (whole blocks) with a cached mamba state
        self.full = set()    # prompt prefixes (whole blocks) with cached attention blocks

    def add_request(self, rid, prompt, params):
        internal = super().add_request(rid, prompt, params)
        self.order.remove(internal)
        r = self.reqs[internal]
        r.spec = 0
        self.waiting.append(internal)
        return internal

    def has_unfinished_requests(self):
        return bool(self.waiting or self.running)

    def _align(self, r, computed, n):
        total = len(r.prompt) + len(r.tokens)
        if computed >= max(len(r.prompt), total - 1):
            return n
        bs = self.bs
        last = total - total % bs
        if self.llm.num_spec:  # use_eagle (MTP): the last block is recomputed
            last = max(last - bs, 0)
        after = computed + n
        if after < last:
            return n // bs * bs
        if computed < last < after:
            return last - computed
        return n

    def _hit(self, r):
        if not self.llm.prefix_caching:
            return 0
        bs = self.bs
        blocks = 0
        # Attention blocks hit up to num_tokens - 1; the mamba state must be
        # cached at the boundary (searched from the right, as MambaManager).
        while (blocks + 1) * bs <= len(r.prompt) - 1:
            if tuple(r.prompt[: (blocks + 1) * bs]) not in self.full:
                break
            blocks += 1
        for m in range(blocks, 0, -1):
            if tuple(r.prompt[: m * bs]) in self.states:
                return m * bs
        return 0

    def _schedule(self):
        llm = self.llm
        k, limit = llm.num_spec, llm.max_model_len
        budget = llm.max_batched
        sched, drafts, new = {}, {}, []
        prefill_scheduled = False
        for rid in list(self.running):
            if budget <= 0:
                break
            r = self.reqs[rid]
            total = len(r.prompt) + len(r.tokens)
            n = min(total + r.spec - r.computed, budget, limit - r.computed - 1)
            if llm.align:
                n = self._align(r, r.computed, n)
            if n <= 0:
                continue
            prefill_scheduled |= r.computed < len(r.prompt)
            sched[rid] = n
            budget -= n
            if r.spec:
                s = n + r.computed - total
                if s > 0:
                    drafts[rid] = min(s, r.spec)
            r.spec = 0
        while self.waiting and budget > 0 and len(self.running) < llm.max_num_seqs:
            rid = self.waiting[0]
            r = self.reqs[rid]
            hit = self._hit(r)
            n = len(r.prompt) - hit
            pad = False
            # "Pad new decode requests to uniform spec decoding size".
            if k and n == 1 and sched and not prefill_scheduled:
                n = 1 + k
                if n > budget or hit + n > limit:
                    break
                pad = True
            n = min(n, budget)
            if llm.align:
                n = self._align(r, hit, n)
            if n <= 0:
                break
            self.waiting.pop(0)
            self.running.append(rid)
            r.computed = hit
            block, was = self._block(rid)
            r.blocks = ([block],)
            r.recycled = was
            new.append(_Obj(req_id=rid, block_ids=r.blocks, num_computed_tokens=hit))
            sched[rid] = n
            budget -= n
            if pad:
                drafts[rid] = k
        return sched, drafts, new

    def _rows(self, sched, finished):
        batch = self.batch
        for i, rid in enumerate(batch):
            if rid is not None and (rid in finished or rid not in sched):
                batch[i] = None
        for rid in sched:
            if rid in batch:
                continue
            holes = [i for i, x in enumerate(batch) if x is None]
            if holes:
                batch[holes[0]] = rid
            else:
                batch.append(rid)
        while True:
            holes = [i for i, x in enumerate(batch) if x is None]
            filled = [i for i, x in enumerate(batch) if x is not None]
            if not holes or not filled or holes[0] > filled[-1]:
                break
            batch[holes[0]], batch[filled[-1]] = batch[filled[-1]], None
        while batch and batch[-1] is None:
            batch.pop()
        threshold = 1 + self.llm.num_spec
        regions = []
        for rid in batch:
            r = self.reqs[rid]
            if r.computed == 0:
                regions.append(3)
            elif sched[rid] > threshold:
                regions.append(2)
            elif r.computed < len(r.prompt):
                regions.append(1)
            else:
                regions.append(0)
        target = sorted(regions)
        swap = [i for i in range(len(batch)) if regions[i] != target[i]]
        src = sorted(swap, key=lambda i: regions[i])
        old = list(batch)
        for dst, s in zip(swap, src):
            batch[dst] = old[s]
        return list(batch)

    def step(self):
        llm = self.llm
        if not self.has_unfinished_requests():
            return []
        sched, drafts, new = self._schedule()
        finished = set(self.finished_ids)
        rows = self._rows(sched, finished)
        out = _Obj(num_scheduled_tokens=sched,
                   scheduled_spec_decode_tokens={rid: [0] * n for rid, n in drafts.items()},
                   scheduled_new_reqs=new, finished_req_ids=finished,
                   scheduled_cached_reqs=_Obj(req_ids=[], new_block_ids=[]))
        self.finished_ids = []
        llm.runner.rows = rows
        llm.runner.engine = self
        llm.runner.execute_model(out)
        results = []
        bs = self.bs
        for rid in rows:
            r = self.reqs[rid]
            r.computed += sched[rid] - drafts.get(rid, 0)
            if r.computed <= len(r.prompt):
                for m in range(1, r.computed // bs + 1):
                    self.full.add(tuple(r.prompt[: m * bs]))
                if r.computed % bs == 0:
                    self.states.add(tuple(r.prompt[: r.computed]))
            position = len(r.prompt) + len(r.tokens)
            if r.computed < position:
                continue  # a prefill chunk: nothing sampled
            token = token_at(r.prompt, position) + r.shift
            r.tokens.append(token)
            r.lps.append(base_lp(token, position) + r.error)
            r.computed = position
            r.spec = llm.num_spec
            done = len(r.tokens) >= r.params.max_tokens or position + 1 >= llm.max_model_len
            if done:
                r.finished = True
                self.finished_ids.append(rid)
                self.running.remove(rid)
                self.free.extend(r.blocks[0])
            lps = [{t: Logprob(lp)} for t, lp in zip(r.tokens, r.lps)]
            results.append(RequestOutput(r.id, [CompletionOutput(list(r.tokens), lps,
                                          "length" if done else None)], done))
        return results


class LLM:
    def __init__(self, model, **kw):
        if os.environ.get("FAKE_VLLM_CRASH") == "1":
            raise RuntimeError("fake engine: CUDA out of memory (on purpose)")
        if os.environ.get("FAKE_VLLM_HANG") == "1":
            time.sleep(60)
        self.kw = kw
        spec = kw.get("speculative_config") or {}
        self.num_spec = int(spec.get("num_speculative_tokens", 0))
        self.max_model_len = int(kw.get("max_model_len", 256))
        self.eager = bool(kw.get("enforce_eager", True))
        from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader
        from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        DummyModelLoader().load_weights(_Obj(), None)
        self.builders = [GDNAttentionMetadataBuilder(self), GDNAttentionMetadataBuilder(self)]
        self.runner = GPUModelRunner(self)
        # A profile build and, with graphs, capture builds: outside any step.
        meta = _Obj(query_start_loc_cpu=[0, 1], num_reqs=1)
        self.builders[0].build(0, meta)
        if not self.eager:
            for b in self.builders:
                b.build_for_cudagraph_capture(meta)
        self.max_num_seqs = int(kw.get("max_num_seqs") or 256)
        self.max_batched = int(kw.get("max_num_batched_tokens") or 8192)
        self.prefix_caching = bool(kw.get("enable_prefix_caching"))
        self.align = kw.get("mamba_cache_mode") == "align"
        faithful = self.prefix_caching or kw.get("max_num_batched_tokens")
        self.llm_engine = _Engine025(self) if faithful else _Engine(self)

    def get_metrics(self):
        return [_Obj(name="vllm:spec_decode_num_drafts", value=0)]

    def generate(self, prompts, params, use_tqdm=False):
        outs = []
        for i, p in enumerate(prompts):
            toks = p["prompt_token_ids"]
            plp = [None] + [{toks[q]: Logprob(base_lp(toks[q], q) + noise(toks[q], q))}
                            for q in range(1, len(toks))]
            outs.append(RequestOutput(str(i), [CompletionOutput([16], None, "length")], True, plp))
        return outs
"""

BUILDER = r"""
class GDNAttentionMetadataBuilder:
    reorder_batch_threshold = 1

    def __init__(self, llm):
        self.use_spec_decode = llm.num_spec > 0
        self.use_full_cuda_graph = not llm.eager
        self.decode_cudagraph_max_bs = 64
        self.half = __import__("os").environ.get("FAKE_VLLM_NEW_ROW", "fixed") in ("half", "fixed")

    def build(self, common_prefix_len, common_attn_metadata, num_accepted_tokens=None,
              num_decode_draft_tokens_cpu=None, fast_build=False):
        m = common_attn_metadata
        q = [b - a for a, b in zip(m.query_start_loc_cpu, m.query_start_loc_cpu[1:])]
        drafts = num_decode_draft_tokens_cpu
        computed = getattr(m, "computed", [1] * len(q))
        if self.use_spec_decode and drafts is not None and any(d >= 0 for d in drafts):
            spec = sum(1 for d in drafts if d >= 0)
            prefills = sum(1 for d, n in zip(drafts, q) if d < 0 and n > 0)
            return _Meta(spec, 0, prefills)
        decodes = 0
        for n, c in zip(q, computed):
            if n != 1 or (self.half and c == 0):
                break
            decodes += 1
        return _Meta(0, decodes, len(q) - decodes)

    def build_for_cudagraph_capture(self, common_attn_metadata):
        return self.build(0, common_attn_metadata)


class _Meta:
    def __init__(self, spec, decodes, prefills):
        self.num_spec_decodes = spec
        self.num_decodes = decodes
        self.num_prefills = prefills
"""

RUNNER = r"""
import os


class _Obj:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Mode:
    def __init__(self, name):
        self.name = name


class FakeGatedDeltaNet:
    def __init__(self):
        self.A_log = [0.5, 1.5]
        self.dt_bias = [-3.0, -2.0]
        self.seen = 0

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        self.seen += 1


class GPUModelRunner:
    def __init__(self, llm):
        self.llm = llm
        self.uniform_decode_query_len = 1 + llm.num_spec
        self.input_batch = _Obj(req_ids=[], num_reqs=0, num_computed_tokens_cpu=[])
        self.layers = {"model.layers.0.linear_attn": FakeGatedDeltaNet()}
        self.compilation_config = _Obj(static_forward_context=self.layers)
        self.kv_cache_config = _Obj(kv_cache_groups=[_Obj(kv_cache_spec=_Obj())])

    def _determine_batch_execution_and_padding(self, num_tokens, num_reqs, uniform):
        if self.llm.eager:
            return (_Mode("NONE"), None)
        mode = (self.llm.kw.get("compilation_config") or {}).get("cudagraph_mode", "")
        full = uniform and mode != "PIECEWISE"
        return (_Mode("FULL" if full else "PIECEWISE"), None)

    def execute_model(self, scheduler_output):
        engine = self.engine
        rows = self.rows
        reqs = [engine.reqs[r] for r in rows]
        n_sched = scheduler_output.num_scheduled_tokens
        q = [n_sched[r] for r in rows]
        self.input_batch = _Obj(req_ids=list(rows), num_reqs=len(rows),
                                num_computed_tokens_cpu=[r.computed for r in reqs])
        uniform = len(set(q)) == 1 and q[0] == self.uniform_decode_query_len
        if os.environ.get("FAKE_VLLM_NEW_ROW", "fixed") == "fixed":
            # The full fix's runner guard: a row with nothing computed keeps
            # the batch off the FULL decode graph.
            uniform = uniform and all(r.computed > 0 for r in reqs)
        mode, _ = self._determine_batch_execution_and_padding(sum(q), len(q), uniform)
        starts = [0]
        for n in q:
            starts.append(starts[-1] + n)
        drafts = [len(scheduler_output.scheduled_spec_decode_tokens[r])
                  if r in scheduler_output.scheduled_spec_decode_tokens else -1 for r in rows]
        meta = _Obj(query_start_loc_cpu=starts, num_reqs=len(rows),
                    computed=[r.computed for r in reqs])
        spec = bool(scheduler_output.scheduled_spec_decode_tokens)
        results = []
        for b in self.llm.builders:
            if spec:
                results.append(b.build(common_prefix_len=0, common_attn_metadata=meta,
                                       num_accepted_tokens=None,
                                       num_decode_draft_tokens_cpu=drafts))
            else:
                results.append(b.build(common_prefix_len=0, common_attn_metadata=meta))
        result = results[0]
        # The bugs the fake can have.
        if os.environ.get("FAKE_VLLM_GATES") == "ungathered" and result.num_spec_decodes:
            before = 0
            for r, n, d in zip(reqs, q, drafts):
                if d >= 0 and before:
                    r.error = 0.05
                if d < 0:
                    before += n
        mode_new = os.environ.get("FAKE_VLLM_NEW_ROW", "fixed")
        for i, (r, n) in enumerate(zip(reqs, q)):
            fresh = r.computed == 0 and n == 1
            if not fresh:
                continue
            decode = i < result.num_decodes and not result.num_spec_decodes
            if mode_new == "bug" and decode and getattr(r, "recycled", False):
                r.error, r.shift = 0.3, 1
            if mode_new == "half" and mode.name == "FULL" and not decode:
                r.error, r.shift = 0.3, 1
                for other in reqs:
                    if other is not r and other.computed > 0:
                        other.error = max(other.error, 0.05)
        # The forward: each GDN layer sees its gate inputs (tokens x heads).
        flat = os.environ.get("FAKE_VLLM_FLAT_GATES") == "1"
        rows_b, rows_a = [], []
        for r, n in zip(reqs, q):
            for j in range(n):
                t = (sum(r.prompt) + r.computed + j) % 23
                rows_b.append([0.0, 0.0] if flat else [(t % 7) - 3.0, (t % 5) - 2.0])
                rows_a.append([0.0, 0.0] if flat else [(t % 3) * 1.5, (t % 4) - 1.0])
        for layer in self.layers.values():
            layer._forward_core(mixed_qkv=None, b=rows_b, a=rows_a, core_attn_out=None)
        return None
"""

LOADER = r"""
class DummyModelLoader:
    calls = 0

    def load_weights(self, model, model_config):
        DummyModelLoader.calls += 1
"""

REGISTRY = """
_TEXT_GENERATION_MODELS = {
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM"),
%s}
"""


def make_site(
    root: Path, classes: tuple[str, ...] = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MTP")
) -> Path:
    """A folder holding the fake ``vllm`` package; returns it (for PYTHONPATH)."""
    site = root / "fake-site"
    pkg = site / "vllm"
    files = {
        "__init__.py": '__version__ = "0.0.fake"\nfrom vllm._engine import LLM, SamplingParams\n',
        "_engine.py": ENGINE,
        "v1/__init__.py": "",
        "v1/attention/__init__.py": "",
        "v1/attention/backends/__init__.py": "",
        "v1/attention/backends/gdn_attn.py": BUILDER,
        "v1/worker/__init__.py": "",
        "v1/worker/gpu_model_runner.py": RUNNER,
        "model_executor/__init__.py": "",
        "model_executor/model_loader/__init__.py": "",
        "model_executor/model_loader/dummy_loader.py": LOADER,
        "model_executor/models/__init__.py": "",
        "model_executor/models/registry.py": REGISTRY
        % "".join(f'    "{c}": ("qwen3_5", "{c}"),\n' for c in classes),
    }
    for rel, text in files.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return site
