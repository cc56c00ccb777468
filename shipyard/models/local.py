"""`LocalEngine`: continuous batching with a transformers causal LM, on CPU or GPU, returning ids and logprobs.

**Continuous batching.** Callers (many episode threads, an HTTP server, the asyncio scheduler) put requests on a queue
(`submit`, `agenerate`, or the blocking `generate`); one engine thread serves them. Each iteration it admits waiting
sequences while fewer than `max_batch` run (prefilling each alone, about `prefill_tokens` prompt tokens per
iteration so that decoding never stalls for long), then runs one decode step for *all* running sequences together and
samples one token per sequence. A sequence that finishes leaves the batch at once and the next waiting one takes its
place: nobody waits for the longest sequence of a batch (static batching's cost with heavy-tailed lengths). How the
rows' caches are kept in one batch — right-aligned with explicit position ids, compacted as rows leave — is in
`shipyard.models.kvbatch`.

**Caches across turns and shared prefills.** A finished sequence's cache is kept under its `GenerationRequest.session`
(`kvbatch.PrefixStore`, bounded by `cache_tokens`, least recently used evicted). A new sequence starts from the
longest cached prefix of its prompt — among kept caches and the sequences running now — and prefills only the rest:
an agent's next turn (its previous context plus a tool's output) prefills the new tokens only, and a group's N
requests for one prompt prefill it once (the first one; the others reuse its cache and feed one token). Sampling is
per sequence (its own `torch.Generator` from its seed), so siblings with distinct seeds draw distinct samples.

**Determinism.** A sequence's result does not depend on its batch-mates: its keys and values are its own (padding
columns are masked), its positions are its own, and its sampler is its own generator. A seeded request gives the same
tokens alone or batched (logprobs equal up to float rounding: a matrix product over a different number of rows may
round differently); tests compare both with one plain full-context forward pass.

**Weights, cancellation, failures.** `update_weights` takes the model lock, which the engine thread holds for each
forward pass, so an update lands between two decode steps: running sequences continue under the new weights, and
their tokens record the version that drew them (`Completion.token_versions`; `policy_version` is the oldest). Kept
caches are dropped on an update (they were computed by the old weights). A request's `cancelled` callback is polled
before each of its tokens; a cancelled sequence leaves the batch with finish_reason "abort". A request that fails
(a prompt the model cannot take, a callback that raises) fails its own future only; its batch-mates run on.

Weight updates are all-or-nothing: the version and every tensor are checked (a version above the current one, known
name, shape, a floating dtype for a floating weight, every value finite, and with `complete=True` every weight of the
model present) before the first one is copied, so a refused push leaves the model and its `policy_version` exactly as
they were — samples are never labelled with a version they were not drawn from, and versions never go backwards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from shipyard.models.engine import Completion, GenerationRequest, VersionConflict, stop_text_index
from shipyard.models.errors import InfraError
from shipyard.models.kvbatch import KV, PrefixStore, RunningBatch, cache_kv, common_prefix, make_cache, prefix


def sample_token(logits: torch.Tensor, temperature: float, top_p: float,
                 generator: torch.Generator | None) -> tuple[int, float]:
    """Sample one token from a row of logits; return (token, logprob under log_softmax(logits / T))."""
    logits = logits.float()
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logp))
        return token, float(logp[token])
    logp = torch.log_softmax(logits / temperature, dim=-1)
    probs = logp.exp()
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses the threshold included).
        keep = (sorted_probs.cumsum(-1) - sorted_probs) < top_p
        sorted_probs = sorted_probs * keep
        token = int(order[torch.multinomial(sorted_probs, 1, generator=generator)])
    else:
        token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(logp[token])


def weight_problem(value: torch.Tensor, target: torch.Tensor) -> str | None:
    """Why `value` cannot replace `target` (a model weight), or None."""
    if value.shape != target.shape:
        return f"has shape {tuple(value.shape)}, the model expects {tuple(target.shape)}"
    if target.is_floating_point() != value.is_floating_point() or value.is_complex():
        return f"has dtype {value.dtype}, the model's is {target.dtype}"
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        bad = int((~torch.isfinite(value)).sum())
        return f"has {bad} values that are not finite (NaN or infinite)"
    return None


class EngineClosed(InfraError, RuntimeError):
    """The engine was closed before this request finished (infrastructure gone: a router retries elsewhere)."""


@dataclass
class _Seq:
    """A request inside the engine."""

    req: GenerationRequest
    future: Future
    start: float
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)  # the ids whose keys and values are in the cache
    prefill_version: int = -1
    finish: str | None = None
    cut: int | None = None  # where a stop string truncates the text


class LocalEngine:
    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str = "local",
                 max_batch: int = 16, prefix_cache: bool = True, cache_tokens: int = 32768,
                 prefill_tokens: int = 2048):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.max_batch = max_batch  # sequences decoded together
        self.prefix_cache = prefix_cache  # reuse cached prefixes (kept caches, running sequences); False: never
        self.prefill_tokens = prefill_tokens  # prompt tokens prefilled per iteration (at least one prompt)
        self.policy_version = 0
        self.device = next(model.parameters()).device
        # The most prompt + completion tokens a sequence may have (None: the config does not say).
        self.max_model_len: int | None = getattr(model.config, "max_position_embeddings", None)
        self.vocab = int(model.get_input_embeddings().num_embeddings)
        # Counters: prefills, prefill_tokens (fed), reused_tokens (taken from a cache), decode_steps, max_running.
        self.stats: dict[str, int] = dict.fromkeys(
            ("prefills", "prefill_tokens", "reused_tokens", "decode_steps", "max_running"), 0)
        self._lock = threading.Lock()  # the model and the prefix store: forward passes, weight copies
        self._cv = threading.Condition()  # the incoming queue, the load count, closing
        self._incoming: deque[_Seq] = deque()
        self._pending = 0  # submitted and not yet resolved
        self._closed = False
        self._thread: threading.Thread | None = None
        # Owned by the engine thread:
        self._waiting: deque[_Seq] = deque()
        self._rows: list[_Seq] = []
        self._batch = RunningBatch()
        self._store = PrefixStore(cache_tokens)
        self._anon = itertools.count()

    # --- the API ----------------------------------------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> Future:
        """Queue a request; its future gives the `Completion` (or the exception that failed it). A prompt that is
        empty or holds ids outside the vocabulary raises ValueError here."""
        self._check(request)
        seed = request.sampling.seed
        seq = _Seq(request, Future(), time.perf_counter(),
                   torch.Generator().manual_seed(seed) if seed is not None else None)
        with self._cv:
            if self._closed:
                raise EngineClosed(f"engine {self.name} is closed")
            self._incoming.append(seq)
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=f"shipyard-engine-{self.name}", daemon=True)
                self._thread.start()
            self._cv.notify()
        return seq.future

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        """Complete every request (batched with whatever else runs); in request order. Raises the first failure,
        after every request has ended."""
        for r in requests:
            self._check(r)
        futures = [self.submit(r) for r in requests]
        out, error = [], None
        for f in futures:
            try:
                out.append(f.result())
            except Exception as e:  # every future is waited for before raising
                error = error or e
        if error is not None:
            raise error
        return out

    async def agenerate(self, request: GenerationRequest) -> Completion:
        """`submit` for asyncio; cancelling the awaiting task stops the sequence at its next step."""
        stop = threading.Event()
        own = request.cancelled
        req = dataclasses.replace(request, cancelled=lambda: stop.is_set() or (own is not None and own()))
        try:
            return await asyncio.wrap_future(self.submit(req))
        except asyncio.CancelledError:
            stop.set()
            raise

    def load(self) -> int:
        """Sequences queued or running."""
        return self._pending

    def close(self) -> None:
        """Stop the engine thread; requests not finished fail with `EngineClosed`."""
        with self._cv:
            self._closed = True
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=30)

    def clear_cache(self) -> None:
        """Forget every kept cache (sessions and prefixes); running sequences keep theirs."""
        with self._lock:
            self._store.clear()

    def _check(self, request: GenerationRequest) -> None:
        ids = request.prompt_ids
        if not ids:
            raise ValueError("a generation request needs a non-empty prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise ValueError(f"prompt token ids out of the model's vocabulary [0, {self.vocab}): {bad[:5]}")

    # --- the engine thread ------------------------------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not (self._incoming or self._waiting or self._rows or self._closed):
                    self._cv.wait()
                if self._closed:
                    break
                self._waiting.extend(self._incoming)
                self._incoming.clear()
            try:
                with torch.inference_mode():
                    self._admit()
                    if self._rows:
                        self._decode()
            except Exception as e:  # a failed decode step: the batch's state is unknown, fail its sequences
                for seq in self._rows:
                    self._fail(seq, e)
                self._rows, self._batch = [], RunningBatch()
        with self._cv:
            left = [*self._incoming, *self._waiting, *self._rows]
            self._incoming.clear()
        for seq in left:
            if seq.future.done():
                continue
            if not seq.future.running():
                seq.future.set_running_or_notify_cancel()
            if not seq.future.cancelled():
                self._fail(seq, EngineClosed(f"engine {self.name} was closed before this request finished"))
        self._waiting.clear()
        self._rows, self._batch = [], RunningBatch()
        self._store.clear()

    def _admit(self) -> None:
        budget = self.prefill_tokens
        joined: list[tuple[_Seq, KV]] = []
        while self._waiting and len(self._rows) + len(joined) < self.max_batch and budget > 0:
            seq = self._waiting.popleft()
            if not seq.future.set_running_or_notify_cancel():  # the caller cancelled its future
                self._release()
                continue
            try:
                if self._cancelled(seq):
                    seq.finish = "abort"
                    self._resolve(seq, None)
                    continue
                kv, logits, version, fed = self._prefill(seq, joined)
                budget -= fed
                self._sample(seq, logits, version)
            except Exception as e:
                self._fail(seq, e)
                continue
            if seq.finish is not None:
                self._resolve(seq, kv)
            else:
                joined.append((seq, kv))
        if joined:
            try:
                self._batch.add([kv for _, kv in joined])  # builds the new cache before replacing the old one
            except Exception as e:  # (out of memory): the joining sequences fail, the running ones go on
                for seq, _ in joined:
                    self._fail(seq, e)
                return
            self._rows += [seq for seq, _ in joined]
            self.stats["max_running"] = max(self.stats["max_running"], len(self._rows))

    def _prefill(self, seq: _Seq, joined: list[tuple[_Seq, KV]]) -> tuple[KV, torch.Tensor, int, int]:
        """Run the prompt's uncached tokens; return the sequence's cache, last logits, the weights version, and the
        number of tokens fed."""
        prompt = seq.req.prompt_ids
        with self._lock:
            source, shared = self._longest_prefix(seq, joined)
            shared = min(shared, len(prompt) - 1)  # at least one token is fed, for the next token's logits
            cache = make_cache(prefix(source, shared) if shared > 0 and source is not None else [])
            ids = torch.tensor([prompt[shared:]], device=self.device)
            mask = torch.ones(1, len(prompt), dtype=torch.long, device=self.device)
            pos = torch.arange(shared, len(prompt), device=self.device)[None, :]
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache,
                             use_cache=True, logits_to_keep=1)
            version = self.policy_version
        seq.fed, seq.prefill_version = list(prompt), version
        self.stats["prefills"] += 1
        self.stats["prefill_tokens"] += len(prompt) - shared
        self.stats["reused_tokens"] += max(shared, 0)
        return cache_kv(cache), out.logits[0, -1].float().cpu(), version, len(prompt) - shared

    def _longest_prefix(self, seq: _Seq, joined: list[tuple[_Seq, KV]]) -> tuple[KV | None, int]:
        """The cache sharing the longest prefix with the prompt: the session's kept cache (taken out of the store:
        the sequence now owns it), any kept cache, a running sequence's or one admitted in this iteration. Only
        caches computed by the current weights."""
        if not self.prefix_cache:
            return None, 0
        prompt = seq.req.prompt_ids
        best: KV | None = None
        shared = 0
        if seq.req.session is not None:
            own = self._store.pop(seq.req.session)
            if own is not None:
                best, shared = own.kv, common_prefix(own.ids, prompt)
        entry, n = self._store.best(prompt)
        if entry is not None and n > shared:
            best, shared = entry.kv, n
        for i, other in enumerate(self._rows):
            if other.prefill_version == self.policy_version and (n := common_prefix(other.fed, prompt)) > shared:
                best, shared = self._batch.row(i), n
        for other, kv in joined:
            if other.prefill_version == self.policy_version and (n := common_prefix(other.fed, prompt)) > shared:
                best, shared = kv, n
        return best, shared

    def _decode(self) -> None:
        rows = self._rows
        ids = torch.tensor([[s.tokens[-1]] for s in rows], device=self.device)
        pos = torch.tensor([[len(s.fed)] for s in rows], device=self.device)
        mask = self._batch.next_mask(self.device)
        with self._lock:
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                             cache=self._batch.cache, use_cache=True)
            version = self.policy_version
        self._batch.grew()
        self.stats["decode_steps"] += 1
        logits = out.logits[:, -1].float().cpu()
        done = []
        for i, seq in enumerate(rows):
            seq.fed.append(seq.tokens[-1])
            try:
                self._sample(seq, logits[i], version)
            except Exception as e:
                self._fail(seq, e)
                done.append(i)
                continue
            if seq.finish is not None:
                self._resolve(seq, self._batch.row(i))
                done.append(i)
        if done:
            keep = [i for i in range(len(rows)) if i not in set(done)]
            self._batch.keep(keep)
            self._rows = [rows[i] for i in keep]

    def _cancelled(self, seq: _Seq) -> bool:
        return seq.req.cancelled is not None and seq.req.cancelled()

    def _sample(self, seq: _Seq, logits: torch.Tensor, version: int) -> None:
        """Draw the sequence's next token (or end it: cancelled, stop token, stop string, length)."""
        if self._cancelled(seq):
            seq.finish = "abort"
            return
        sp = seq.req.sampling
        token, lp = sample_token(logits, sp.temperature, sp.top_p, seq.generator)
        seq.tokens.append(token)
        seq.logprobs.append(lp)
        seq.versions.append(version)
        if token in sp.stop_token_ids:
            seq.finish = "stop"
        elif sp.stop:
            hit = stop_text_index(self.tokenizer.decode(seq.tokens, skip_special_tokens=False), sp.stop)
            if hit != -1:
                seq.finish, seq.cut = "stop", hit
        if seq.finish is None and len(seq.tokens) >= sp.max_tokens:
            seq.finish = "length"

    def _resolve(self, seq: _Seq, kv: KV | None) -> None:
        """Complete the sequence's future, and keep its cache for the next turn."""
        if kv is not None and self.prefix_cache:
            with self._lock:
                if seq.prefill_version == self.policy_version:  # not mixed with weights that are gone
                    self._store.put(seq.req.session or f"\0anonymous-{next(self._anon)}", seq.fed, kv)
        text = self.tokenizer.decode(seq.tokens, skip_special_tokens=True)
        if seq.cut is not None:
            text = self.tokenizer.decode(seq.tokens, skip_special_tokens=False)[: seq.cut]
        versions = seq.versions
        oldest = min(versions) if versions else self.policy_version
        seq.future.set_result(Completion(
            seq.tokens, seq.logprobs, text, seq.finish or "length", len(seq.req.prompt_ids), oldest,  # type: ignore[arg-type]
            time.perf_counter() - seq.start, list(versions) if len(set(versions)) > 1 else []))
        self._release()

    def _fail(self, seq: _Seq, error: BaseException) -> None:
        if not seq.future.done():
            seq.future.set_exception(error)
        self._release()

    def _release(self) -> None:
        with self._cv:
            self._pending -= 1

    def update_weights(self, version: int, tensors: Mapping[str, torch.Tensor], complete: bool = False) -> None:
        """Load `tensors` (state-dict names) as `version`, which must be above `policy_version`. With `complete`
        (what `shipyard serve` asks for a pushed payload) they must cover every floating tensor of the model's state
        dict — tied weights under each of their names, as `shipyard.models.payload.decode` returns them — so a push
        labelled as a new version cannot leave most of the model at the old one. All or nothing."""
        self._check_version(version)
        own = self.model.state_dict()
        unknown = sorted(set(tensors) - set(own))
        if unknown:
            raise KeyError(f"update_weights got tensors the model does not have: {unknown[:5]}; nothing was loaded")
        if complete:
            weights = [k for k, v in own.items() if v.is_floating_point()]
            missing = [k for k in weights if k not in tensors]
            if missing:
                more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
                raise ValueError(f"update_weights: the push holds {len(weights) - len(missing)} of the model's "
                                 f"{len(weights)} weight tensors, missing {', '.join(missing[:5])}{more}; a push must "
                                 "carry the whole state dict (shipyard.models.payload.encode(model.state_dict(), ...): "
                                 "tied weights once, the others named in its aliases); nothing was loaded, the model "
                                 f"stays at version {self.policy_version}")
        for key, value in tensors.items():  # everything is checked before anything is copied: all or nothing
            problem = weight_problem(value, own[key])
            if problem:
                raise ValueError(f"update_weights: {key} {problem}; nothing was loaded, the model stays at "
                                 f"version {self.policy_version}")
        with self._lock, torch.no_grad():  # between two forward passes of the engine thread
            self._check_version(version)  # again under the lock: another update may have landed meanwhile
            for key, value in tensors.items():
                own[key].copy_(value)
            self.policy_version = version
            self._store.clear()  # kept caches were computed by the old weights

    def _check_version(self, version: int) -> None:
        if version <= self.policy_version:
            raise VersionConflict(f"weights version {version} is not newer than the served version "
                                  f"{self.policy_version}: versions must be increasing, so that every sample is "
                                  f"labelled with the weights that drew it; push a version above "
                                  f"{self.policy_version} (nothing was loaded)")
