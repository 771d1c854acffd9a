"""A small reference engine: continuous batching over a paged cache, with page tags on (docs/engine.md).

::

    engine = Engine(model, kv_format="bf16", num_pages=256, page_size=16)         # one instance
    engine = Engine.from_recipe(model, recipe, num_pages=256)                      # per-phase formats
    rid = engine.add_request(prompt_ids, SamplingParams(max_new_tokens=32))
    while engine.has_unfinished():
        for result in engine.step():          # RequestResult of the requests that finished this step
            ...
    results = engine.generate(prompts, SamplingParams(...))                        # the same, in order

A step runs (two-pool recipes) the hand-off of prefilled requests to the decode pool, one batched decode
forward, and one chunked-prefill forward (``Scheduler``). Before each forward, the pool's
``PageTagTracker`` verifies the whole batch in one launch: a request whose table points at a page it no
longer owns is aborted with the reason, and the step goes on without it.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from itertools import count

import torch

from ..cache import NoopTagTracker, PageAllocator, PagedBatch
from ..formats.plan import PhaseRecipe, build_pools, handoff_kv, quantize_
from .request import Request, RequestResult, SamplingParams, Status, check_prompt
from .sampling import sample
from .scheduler import Pool, PrefixCache, Scheduler


@dataclass
class EngineStats:
    """Counters and wall times (seconds) since the engine was built."""

    steps: int = 0
    prefill_steps: int = 0
    prefill_tokens: int = 0      # prompt (and recomputed) tokens run through prefill forwards
    prefill_s: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0       # tokens produced by decode forwards
    decode_s: float = 0.0
    handoffs: int = 0            # requests moved to the decode pool
    handoff_pages: int = 0
    handoff_s: float = 0.0
    tag_checks: int = 0          # batched page-tag verifications
    aborts: int = 0              # requests aborted by a tag mismatch
    preemptions: int = 0
    cached_tokens: int = 0       # prompt tokens served from shared prefix pages
    shared_pages: int = 0        # prefix pages forked instead of computed

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0


def _phase_kv(phase, model) -> object:
    """A phase's KV format per layer (its plan's KV rules), or its default format for all layers."""
    fmts = phase.kv_formats(model)
    return fmts if len(fmts) == model.config.num_hidden_layers else phase.kv


class Engine:
    """Continuous batching over one model (symmetric formats) or a prefill and a decode instance.

    Args:
        model: a causal LM with the cached path (``model(ids [T], batch=PagedBatch, cache=...)``,
            ``model.allocate_cache``, ``model.config``): ``KimiK26ForCausalLM``, ``Glm52ForCausalLM``.
        decode_model: a second instance for decode (two pools, KV handed off after prefill); None: one pool.
        kv_format / decode_kv_format: KV format of each pool's pages (one, or one per layer).
        num_pages / decode_num_pages: pages per pool; page_size: tokens per page.
        max_num_batched_tokens: prefill tokens per step (chunked prefill budget).
        max_num_seqs: admitted requests at most (prefill, hand-off and decode together).
        max_model_len: longest sequence (default: ``config.max_position_embeddings``).
        page_tags: verify page tags before every forward and abort mismatching requests (default on).
        prefix_caching: share full pages of identical prompt prefixes (prefill pool).
        record_logits: keep each sampled position's logits in the results (for fidelity metrics).
    """

    def __init__(self, model, *, decode_model=None, kv_format="bf16", decode_kv_format=None, num_pages: int = 256,
                 decode_num_pages: int | None = None, page_size: int = 16, max_num_batched_tokens: int = 256,
                 max_num_seqs: int = 64, max_model_len: int | None = None, page_tags: bool = True,
                 prefix_caching: bool = True, record_logits: bool = False):
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError(f"max_num_batched_tokens {max_num_batched_tokens} and max_num_seqs {max_num_seqs} "
                             "must be at least 1")
        config = model.config
        self.vocab_size = config.vocab_size
        self.max_model_len = int(max_model_len or config.max_position_embeddings)
        if not 2 <= self.max_model_len <= config.max_position_embeddings:
            raise ValueError(f"max_model_len: {self.max_model_len} outside [2, {config.max_position_embeddings}] "
                             "(max_position_embeddings)")
        self.record_logits, self.page_tags = record_logits, page_tags
        prefill = self._pool("prefill", model, num_pages, page_size, kv_format, prefix_caching)
        if decode_model is None:
            if decode_kv_format is not None or decode_num_pages is not None:
                raise ValueError("decode_kv_format / decode_num_pages: only with a decode_model (two pools)")
            decode = prefill
        else:
            decode = self._pool("decode", decode_model, decode_num_pages or num_pages, page_size,
                                kv_format if decode_kv_format is None else decode_kv_format, prefix_caching=False)
        self.scheduler = Scheduler(prefill, decode, max_num_batched_tokens, max_num_seqs)
        self.stats = EngineStats()
        self._requests: dict[Hashable, Request] = {}
        self._faults: dict[Hashable, int] = {}
        self._ids = count()

    def _pool(self, name: str, model, num_pages: int, page_size: int, kv_format, prefix_caching: bool) -> Pool:
        cache = model.allocate_cache(num_pages, page_size, kv_format)
        tracker = None if self.page_tags else NoopTagTracker()
        allocator = PageAllocator(cache=cache, tracker=tracker)
        return Pool(name, model, cache, allocator, PrefixCache(allocator) if prefix_caching else None)

    @classmethod
    def from_recipe(cls, model, recipe: PhaseRecipe, **kwargs) -> "Engine":
        """An engine serving ``recipe``: one instance (quantized in place) when both phases use the same
        formats, else a prefill and a decode instance (``build_pools``: ``model`` becomes the decode one)
        with the KV handed off — and converted, e.g. BF16 → FP8 — after prefill."""
        if recipe.prefill == recipe.decode:
            if recipe.prefill.weights is not None:
                quantize_(model, recipe.prefill.weights)
            return cls(model, kv_format=_phase_kv(recipe.prefill, model), **kwargs)
        prefill, decode = build_pools(model, recipe)
        return cls(prefill, decode_model=decode, kv_format=_phase_kv(recipe.prefill, prefill),
                   decode_kv_format=_phase_kv(recipe.decode, decode), **kwargs)

    # ------------------------------------------------------------------------------------ pools
    @property
    def prefill_pool(self) -> Pool:
        return self.scheduler.prefill

    @property
    def decode_pool(self) -> Pool:
        return self.scheduler.decode

    @property
    def pools(self) -> tuple[Pool, ...]:
        return (self.prefill_pool, self.decode_pool) if self.scheduler.two_pools else (self.prefill_pool,)

    def _now(self) -> float:
        for pool in self.pools:
            if pool.cache.device.type == "cuda":
                torch.cuda.synchronize(pool.cache.device)
        return time.perf_counter()

    # ------------------------------------------------------------------------------------ requests
    def add_request(self, prompt_ids: Sequence[int] | torch.Tensor, params: SamplingParams | None = None,
                    request_id: Hashable | None = None) -> Hashable:
        """Queue a request; returns its id. Raises ValueError for an empty prompt, unknown token ids, a prompt
        that fills the context, or a request whose KV could never fit in a pool (a queue longer than the
        cache is fine: requests wait for pages)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params: expected SamplingParams, got {type(params).__name__}")
        rid = next(self._ids) if request_id is None else request_id
        while request_id is None and rid in self._requests:
            rid = next(self._ids)
        if rid in self._requests:
            raise ValueError(f"request_id: {rid!r} is already in the engine")
        prompt = check_prompt(prompt_ids, self.vocab_size, self.max_model_len)
        kv_tokens = min(len(prompt) + params.max_new_tokens, self.max_model_len) - 1   # the last token is not fed
        for pool in self.pools:
            if pool.pages_for(kv_tokens) > pool.allocator.num_pages:
                raise ValueError(f"request {rid!r}: {kv_tokens} tokens of KV need {pool.pages_for(kv_tokens)} pages "
                                 f"of {pool.page_size}; the {pool.name} pool has {pool.allocator.num_pages}")
        req = Request(rid, prompt, params, time.perf_counter())
        self._requests[rid] = req
        self.scheduler.add(req)
        return rid

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def request(self, request_id: Hashable) -> Request | None:
        """The live state of an unfinished request (read it, don't change it), or None."""
        return self._requests.get(request_id)

    def state(self, request_id: Hashable) -> Status:
        return self._requests[request_id].status

    def abort_request(self, request_id: Hashable, reason: str = "aborted by the caller") -> RequestResult:
        req = self._requests[request_id]
        self.scheduler.abort(req)
        return self._end(req, Status.ABORTED, "aborted", reason)

    def inject_fault(self, request_id: Hashable, entry: int = 0) -> None:
        """Testing hook: at the next forward that includes ``request_id``, overwrite entry ``entry`` of its
        block-table row with another request's page (a corrupted page-table entry). With page tags on, the
        request is aborted before the forward; with tags off, it reads the wrong page."""
        if request_id not in self._requests:
            raise KeyError(f"request_id: {request_id!r} is not in the engine")
        self._faults[request_id] = int(entry)

    # ------------------------------------------------------------------------------------ stepping
    def step(self) -> list[RequestResult]:
        """One engine step (hand-offs, a decode forward, a prefill forward). Returns the requests that
        finished or were aborted in it."""
        done: list[RequestResult] = []
        progressed = self._handoff(done) if self.scheduler.two_pools else False
        sched = self.scheduler.schedule_decode()
        if sched is not None:
            self._decode(*sched, done)
            progressed = True
        sched = self.scheduler.schedule_prefill()
        if sched is not None:
            self._prefill(*sched, done)
            progressed = True
        if not progressed and self.scheduler.has_unfinished() and not self.scheduler.unstick():
            raise RuntimeError(f"engine stalled with {len(self.scheduler.waiting)} waiting and "
                               f"{len(self.scheduler.running)} running requests")
        self.stats.steps += 1
        self.stats.preemptions = self.scheduler.num_preemptions
        self.stats.cached_tokens = self.scheduler.num_cached_tokens
        self.stats.shared_pages = self.scheduler.num_cached_tokens // self.prefill_pool.page_size
        return done

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 on_step: Callable[["Engine"], None] | None = None) -> list[RequestResult]:
        """Run ``prompts`` to completion; results in prompt order. ``on_step(engine)`` after each step."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: {len(plist)} for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        results: dict[Hashable, RequestResult] = {}
        while any(i not in results for i in ids):
            for r in self.step():
                results[r.request_id] = r
            if on_step is not None:
                on_step(self)
        return [results[i] for i in ids]

    # ------------------------------------------------------------------------------------ phases
    def _decode(self, reqs: list[Request], batch: PagedBatch, done: list) -> None:
        pool, t0 = self.decode_pool, self._now()
        keep = self._verify(pool, reqs, batch, done)
        if keep is None:
            return
        reqs, batch = [reqs[i] for i in keep], batch.select(keep) if len(keep) < len(reqs) else batch
        ids = torch.tensor([r.tokens[-1] for r in reqs], dtype=torch.long, device=pool.cache.device)
        with torch.no_grad():
            logits = pool.model(ids, batch=batch, cache=pool.cache)                       # [B, vocab]
        for r in reqs:
            r.num_computed += 1
        self._sample(reqs, logits, done)
        self.stats.decode_steps += 1
        self.stats.decode_tokens += len(reqs)
        self.stats.decode_s += self._now() - t0

    def _prefill(self, reqs: list[Request], counts: list[int], batch: PagedBatch, done: list) -> None:
        pool, t0 = self.prefill_pool, self._now()
        keep = self._verify(pool, reqs, batch, done)
        if keep is None:
            return
        if len(keep) < len(reqs):
            reqs, counts, batch = [reqs[i] for i in keep], [counts[i] for i in keep], batch.select(keep)
        ids = [t for r, n in zip(reqs, counts) for t in r.tokens[r.num_computed:r.num_computed + n]]
        ids = torch.tensor(ids, dtype=torch.long, device=pool.cache.device)
        with torch.no_grad():
            logits = pool.model(ids, batch=batch, cache=pool.cache,
                                logits_index=batch.cu_seqlens_q[1:].long() - 1)                # [B, vocab]
        self.scheduler.prefilled(reqs, counts)
        ready = [i for i, r in enumerate(reqs) if r.num_computed == r.prefill_target]
        fresh = [i for i in ready if reqs[i].samples_after_prefill]
        after = Status.HANDOFF if self.scheduler.two_pools else Status.DECODE
        for i in ready:
            reqs[i].status = after
        if fresh:
            self._sample([reqs[i] for i in fresh], logits[fresh], done)
        self.stats.prefill_steps += 1
        self.stats.prefill_tokens += sum(counts)
        self.stats.prefill_s += self._now() - t0

    def _handoff(self, done: list) -> bool:
        """Move prefilled requests' pages to the decode pool (converting their KV format); tags checked first."""
        moved = self.scheduler.schedule_handoffs()
        if not moved:
            return False
        src_pool, dst_pool, t0 = self.prefill_pool, self.decode_pool, self._now()
        failed = self._verify_tables(src_pool, moved, done, cleanup=lambda r: dst_pool.allocator.free(r.id))
        moved = [r for r in moved if r not in failed]
        src = [p for r in moved for p in src_pool.allocator.pages(r.id)]
        dst = [p for r in moved for p in dst_pool.allocator.pages(r.id)]
        handoff_kv(src_pool.cache.kv, dst_pool.cache.kv, src, dst)
        if getattr(src_pool.cache, "indexer", None) is not None:
            src_pool.cache.indexer.copy_pages_to(dst_pool.cache.indexer, src, dst)
        for r in moved:
            self.scheduler.handed_off(r)
        self.stats.handoffs += len(moved)
        self.stats.handoff_pages += len(src)
        self.stats.handoff_s += self._now() - t0
        return True

    # ------------------------------------------------------------------------------------ tags
    def _inject(self, pool: Pool, batch: PagedBatch) -> None:
        for row, rid in enumerate(batch.request_ids):
            if rid not in self._faults:
                continue
            n = pool.pages_for(int(batch.seq_lens[row]))
            entry = min(self._faults.pop(rid), n - 1)
            own = int(batch.block_table[row, entry])
            others = [p for p in batch.block_table.flatten().tolist() if p >= 0 and p != own]
            batch.block_table[row, entry] = others[0] if others else (own + 1) % pool.allocator.num_pages

    def _verify(self, pool: Pool, reqs: list[Request], batch: PagedBatch, done: list) -> list[int] | None:
        """Verify the step's tables and writes in one launch; abort the failing requests. Returns the rows
        that go on (None when none do)."""
        self._inject(pool, batch)
        tracker = pool.allocator.tracker
        if not tracker.enabled:
            return list(range(len(reqs)))
        self.stats.tag_checks += 1
        failed = tracker.verify_batch(batch).cpu()
        if bool(failed.any()):
            err = tracker.mismatch(batch.request_ids, batch.block_table, batch.seq_lens, failed)
            for i in failed.nonzero().flatten().tolist():
                self._abort(reqs[i], err.pages.get(reqs[i].id, []), done)
        keep = [i for i in range(len(reqs)) if not bool(failed[i])]
        return keep or None

    def _verify_tables(self, pool: Pool, reqs: list[Request], done: list, cleanup=None) -> list[Request]:
        """Verify requests' current tables in ``pool`` (reads only); abort and return the failing ones."""
        tracker = pool.allocator.tracker
        if not tracker.enabled:
            return []
        self.stats.tag_checks += 1
        ids = [r.id for r in reqs]
        table, seq_lens = pool.allocator.block_table(ids, pool.cache.device)
        failed = tracker.verify(ids, table, seq_lens).cpu()
        bad = [reqs[i] for i in failed.nonzero().flatten().tolist()]
        if bad:
            err = tracker.mismatch(ids, table, seq_lens, failed)
            for r in bad:
                if cleanup is not None:
                    cleanup(r)
                self._abort(r, err.pages.get(r.id, []), done)
        return bad

    def _abort(self, req: Request, pages: list, done: list) -> None:
        what = ", ".join(f"entry {e} -> page {p} has tag {have}, recorded {want}" for e, p, want, have in pages[:3])
        kept = self.scheduler.abort(req)
        reason = f"page tag mismatch ({what or 'table or lengths'})"
        if kept:
            reason += f"; {len(kept)} page(s) left to their current owners"
        self.stats.aborts += 1
        done.append(self._end(req, Status.ABORTED, "aborted", reason))

    # ------------------------------------------------------------------------------------ results
    def _sample(self, reqs: list[Request], logits: torch.Tensor, done: list) -> None:
        tokens = sample(logits, [r.params for r in reqs], [len(r.output) for r in reqs])
        rows = logits.float().cpu() if self.record_logits else None
        now = self._now()
        for i, (r, t) in enumerate(zip(reqs, tokens)):
            r.tokens.append(t)
            r.token_s.append(now)
            if r.first_token_s is None:
                r.first_token_s = now
            if rows is not None:
                r.logits.append(rows[i])
            if t in r.params.stop_token_ids:
                self._finish(r, "stop", done)
            elif len(r.output) >= r.params.max_new_tokens or len(r.tokens) >= self.max_model_len:
                self._finish(r, "length", done)

    def _finish(self, req: Request, reason: str, done: list) -> None:
        self.scheduler.release(req)
        done.append(self._end(req, Status.FINISHED, reason))

    def _end(self, req: Request, status: Status, reason: str, abort_reason: str | None = None) -> RequestResult:
        req.status = status
        self._requests.pop(req.id, None)
        self._faults.pop(req.id, None)
        return req.result(reason, time.perf_counter(), abort_reason)


__all__ = ["Engine", "EngineStats"]
