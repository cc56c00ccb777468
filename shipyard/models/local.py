"""`LocalEngine`: batched sampling with a transformers causal LM, on CPU or GPU, returning ids and logprobs.

Generation is a plain loop over `model.forward` with a KV cache (`DynamicCache`), not `model.generate`, so
that every row can have its own temperature, top-p, seed, stop tokens and stop strings, and so that the
logprob of each sampled token is the sampler's own (see `shipyard.models.engine` for the convention).

Batching: prompts are left-padded; position ids are computed from the attention mask so that padding does
not shift positions. Rows that finish keep stepping (with their output ignored) until the batch finishes —
simple, and on the sizes used here cheaper than compacting the cache.

Prefix reuse: an agent's next prompt is its previous context plus a few hundred new tokens. For single-row
requests the engine keeps the KV cache of the last sequence and, when the new prompt extends it, crops the
cache to the shared prefix and prefills only the new tokens (on CPU this turns a multi-second prefill of a
long context into a fraction of a second).

Determinism: with a `seed`, a row's sampling uses its own `torch.Generator`, so the same request gives the
same completion.

Cancellation: a request's `cancelled` callback is polled before each of its decode steps; a cancelled row stops
(finish_reason "abort") and the batch ends as soon as every row has stopped, so a server stops spending compute on
a client that has gone, and can shut down between two steps.

Weight updates are all-or-nothing: the version and every tensor are checked (a version above the current one, known
name, shape, a floating dtype for a floating weight, every value finite, and with `complete=True` every weight of the
model present) before the first one is copied, so a refused push leaves the model and its `policy_version` exactly as
they were — samples are never labelled with a version they were not drawn from, and versions never go backwards.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from shipyard.models.engine import Completion, GenerationRequest, VersionConflict, stop_text_index


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


class LocalEngine:
    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str = "local",
                 max_batch: int = 8, prefix_cache: bool = True):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.max_batch = max_batch
        self.prefix_cache = prefix_cache
        self.policy_version = 0
        self.device = next(model.parameters()).device
        # The most prompt + completion tokens a sequence may have (None: the config does not say).
        self.max_model_len: int | None = getattr(model.config, "max_position_embeddings", None)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad if pad is not None else 0)
        self._lock = threading.Lock()
        self._cached_ids: list[int] = []
        self._cache: DynamicCache | None = None

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        out: list[Completion] = []
        with self._lock, torch.inference_mode():
            try:
                for i in range(0, len(requests), self.max_batch):
                    out += self._generate_batch(requests[i:i + self.max_batch])
            except BaseException:
                self._cached_ids, self._cache = [], None  # a failed step may have left the prefix cache half-grown
                raise
        return out

    def _prefill(self, reqs: list[GenerationRequest]) -> tuple[torch.Tensor, DynamicCache, torch.Tensor, list[int]]:
        """Run the prompts; return last-position logits, the cache, the attention mask and the ids fed."""
        for r in reqs:
            if not r.prompt_ids:
                raise ValueError("a generation request needs a non-empty prompt")
        if len(reqs) == 1 and self.prefix_cache and self._cache is not None:
            prompt = reqs[0].prompt_ids
            shared = 0
            for a, b in zip(self._cached_ids, prompt, strict=False):
                if a != b:
                    break
                shared += 1
            shared = min(shared, len(prompt) - 1)  # at least one new token must be fed to get logits
            if shared > 0:
                cache = self._cache
                cache.crop(-(cache.get_seq_length() - shared))  # transformers 5: a negative count of tokens to drop
                new = torch.tensor([prompt[shared:]], device=self.device)
                mask = torch.ones(1, len(prompt), dtype=torch.long, device=self.device)
                pos = torch.arange(shared, len(prompt), device=self.device).unsqueeze(0)
                logits = self.model(input_ids=new, attention_mask=mask, position_ids=pos, past_key_values=cache,
                                    use_cache=True).logits[:, -1, :]
                return logits, cache, mask, list(prompt)
        width = max(len(r.prompt_ids) for r in reqs)
        ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for row, r in enumerate(reqs):
            ids[row, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[row, width - len(r.prompt_ids):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                            use_cache=True).logits[:, -1, :]
        return logits, cache, mask, list(reqs[0].prompt_ids)

    def _generate_batch(self, reqs: list[GenerationRequest]) -> list[Completion]:
        start = time.perf_counter()
        logits, cache, mask, fed = self._prefill(reqs)
        gens = [torch.Generator().manual_seed(r.sampling.seed) if r.sampling.seed is not None else None for r in reqs]
        tokens: list[list[int]] = [[] for _ in reqs]
        logps: list[list[float]] = [[] for _ in reqs]
        finish: list[str | None] = [None] * len(reqs)
        cut: list[int | None] = [None] * len(reqs)  # where a stop string truncates the text
        max_steps = max(r.sampling.max_tokens for r in reqs)
        positions = mask.sum(-1, keepdim=True) - 1
        for _ in range(max_steps):
            step = []
            for row, r in enumerate(reqs):
                if finish[row] is None and r.cancelled is not None and r.cancelled():
                    finish[row] = "abort"
                if finish[row] is not None:
                    step.append(self.pad_id)
                    continue
                sp = r.sampling
                token, lp = sample_token(logits[row].cpu(), sp.temperature, sp.top_p, gens[row])
                tokens[row].append(token)
                logps[row].append(lp)
                step.append(token)
                if token in sp.stop_token_ids:
                    finish[row] = "stop"
                elif sp.stop:
                    text = self.tokenizer.decode(tokens[row], skip_special_tokens=False)
                    hit = stop_text_index(text, sp.stop)
                    if hit != -1:
                        finish[row], cut[row] = "stop", hit
                if finish[row] is None and len(tokens[row]) >= sp.max_tokens:
                    finish[row] = "length"
            if all(f is not None for f in finish):
                break
            if len(reqs) == 1:
                fed.append(step[0])
            positions = positions + 1
            mask = torch.cat([mask, torch.ones((len(reqs), 1), dtype=mask.dtype, device=self.device)], dim=-1)
            logits = self.model(input_ids=torch.tensor([[t] for t in step], device=self.device),
                                attention_mask=mask, position_ids=positions, past_key_values=cache,
                                use_cache=True).logits[:, -1, :]
        if len(reqs) == 1 and self.prefix_cache:
            self._cached_ids, self._cache = fed, cache
        else:
            self._cached_ids, self._cache = [], None
        seconds = time.perf_counter() - start
        out = []
        for row, r in enumerate(reqs):
            text = self.tokenizer.decode(tokens[row], skip_special_tokens=True)
            if cut[row] is not None:
                text = self.tokenizer.decode(tokens[row], skip_special_tokens=False)[: cut[row]]
            out.append(Completion(tokens[row], logps[row], text, finish[row] or "length", len(r.prompt_ids),
                                  self.policy_version, seconds))
        return out

    def update_weights(self, version: int, tensors: Mapping[str, torch.Tensor], complete: bool = False) -> None:
        """Load `tensors` (state-dict names) as `version`, which must be above `policy_version`. With `complete`
        (what `shipyard serve` asks for a pushed payload) they must cover every floating tensor of the model's state
        dict — tied weights under each of their names, as `shipyard.train.sync.decode` returns them — so a push
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
                                 "carry the whole state dict (shipyard.train.sync.encode(model.state_dict(), ...): "
                                 "tied weights once, the others named in its aliases); nothing was loaded, the model "
                                 f"stays at version {self.policy_version}")
        for key, value in tensors.items():  # everything is checked before anything is copied: all or nothing
            problem = weight_problem(value, own[key])
            if problem:
                raise ValueError(f"update_weights: {key} {problem}; nothing was loaded, the model stays at "
                                 f"version {self.policy_version}")
        with self._lock, torch.no_grad():
            self._check_version(version)  # again under the lock: another update may have landed meanwhile
            for key, value in tensors.items():
                own[key].copy_(value)
            self.policy_version = version
            self._cached_ids, self._cache = [], None

    def _check_version(self, version: int) -> None:
        if version <= self.policy_version:
            raise VersionConflict(f"weights version {version} is not newer than the served version "
                                  f"{self.policy_version}: versions must be increasing, so that every sample is "
                                  f"labelled with the weights that drew it; push a version above "
                                  f"{self.policy_version} (nothing was loaded)")

    def close(self) -> None:
        self._cache = None
