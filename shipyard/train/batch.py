"""The `Batch` the trainer consumes: what the rollout server hands over, as padded tensors.

One row per trajectory, in token coordinates: `input_ids[b, t]` is the t-th token of the episode (prompt, then
per turn the sampled completion and the rendered observation). Per-token fields describe *that token*:

- `loss_mask[b, t] = 1` when token t was sampled by the policy (a completion token), 0 for prompt, observations
  and padding — the trainer learns only from what the model chose;
- `sampler_logprobs[b, t]`: the sampler's log-probability of token t (for the importance-sampling correction
  between the inference engine and the trainer);
- `advantages[b, t]`: the sample's advantage, on every token of the row (a per-token advantage also fits);
- `versions[b, t]`: the policy version that sampled token t (trajectories can span weight updates).

`sample_mask[b] = 0` marks a sample whose reward is unknown (an infrastructure failure): it contributes nothing —
never a zero reward. The model predicts token t from positions < t, so losses pair the logits at t−1 with token t
(`shift`).

Targeted self-distillation: `hints` places each `Hint` (`shipyard.rollout.record`) in token coordinates (`HintTarget`,
`place_hint`): the hint's token ids go right before its turn's assistant header in the teacher's context; the
student's own row is never changed. Everything else about it is in `shipyard.train.distill`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from shipyard.harness.trajectory import Trajectory
from shipyard.rollout.batches import RolloutBatch
from shipyard.rollout.record import Hint


@dataclass(frozen=True)
class HintTarget:
    """A hint placed in token coordinates of row `sample`: insert at `insert_at`, loss on [start, end)."""

    sample: int
    insert_at: int
    hint_ids: tuple[int, ...]
    start: int
    end: int
    kinds: tuple[str, ...] = ()  # the hint's kinds (Hint.kinds): its lift is reported per kind


def turn_span(traj: Trajectory, turn: int) -> tuple[int, int]:
    """[start, end) of turn `turn`'s completion tokens in the trajectory's token sequence."""
    if not 0 <= turn < len(traj.turns):
        raise ValueError(f"turn {turn} does not exist: the trajectory has {len(traj.turns)} turns")
    pos = len(traj.prompt_ids)
    for t in traj.turns[:turn]:
        pos += len(t.completion_ids) + len(t.observation_ids)
    return pos, pos + len(traj.turns[turn].completion_ids)


def place_hint(traj: Trajectory, hint: Hint, header_ids: tuple[int, ...]) -> HintTarget:
    """Where a hint goes: before the assistant header that opens the target turn (checked against the ids)."""
    start, end = turn_span(traj, hint.turn)
    insert_at = start - len(header_ids)
    ids = traj.token_ids()
    if insert_at < 0 or tuple(ids[insert_at:start]) != tuple(header_ids):
        raise ValueError(f"turn {hint.turn} of sample {hint.sample} is not preceded by the assistant header "
                         f"{list(header_ids)}; pass the header ids of the chat format the trajectory was made with")
    if end == start:
        raise ValueError(f"turn {hint.turn} of sample {hint.sample} has no sampled tokens to distill")
    return HintTarget(hint.sample, insert_at, tuple(hint.hint_ids), start, end, tuple(hint.kinds))


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] long, right-padded with pad_id
    attention_mask: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T] float
    sampler_logprobs: torch.Tensor  # [B, T] float
    advantages: torch.Tensor  # [B, T] float
    versions: torch.Tensor  # [B, T] long (0 where not sampled)
    sample_mask: torch.Tensor  # [B] float: 0 = infra-failed sample, excluded
    hints: list[HintTarget] = field(default_factory=list)
    pad_id: int = 0

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def tokens(self) -> int:
        """Sampled tokens that count toward the loss."""
        return int((self.loss_mask * self.sample_mask[:, None]).sum())

    def to(self, device: torch.device | str) -> Batch:
        moved = {k: v.to(device) for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        return Batch(**moved, hints=self.hints, pad_id=self.pad_id)

    def rows(self, index: list[int]) -> Batch:
        """A sub-batch of the given rows (hints renumbered), e.g. one data-parallel rank's or one micro-batch."""
        pick = torch.tensor(index, dtype=torch.long)
        tensors = {k: v[pick] for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        where = {old: new for new, old in enumerate(index)}
        hints = [replace(h, sample=where[h.sample]) for h in self.hints if h.sample in where]
        return Batch(**tensors, hints=hints, pad_id=self.pad_id)

    def trained(self) -> torch.Tensor:
        """[B, T] bool: the positions trained on — a sampled token the model predicts (loss mask, from position 1) or
        a hint's target."""
        trained = self.loss_mask > 0
        trained[:, 0] = False  # the first token is never predicted
        for h in self.hints:
            trained[h.sample, h.start:h.end] = True
        return trained

    def trimmed(self) -> Batch:
        """Each row cut after its last trained token (`trained`), the batch narrowed to the longest row. Nothing
        trained attends to a later position, so the step's loss and gradients are the same up to float summation
        order (the rows may be grouped and packed otherwise) — and it is what bounds a step by configuration: an
        episode's context is checked against its budget (`max_tokens`) before each turn, so the last observation (a
        tool output of up to `max_output_bytes` per call, after the final completion) can run far past it; every
        trained token lies within it. A row with nothing trained keeps its first two tokens at most."""
        trained = self.trained()
        last = torch.where(trained, torch.arange(trained.shape[1], device=trained.device), -1).amax(-1)
        lengths = self.attention_mask.sum(-1)
        ends = torch.where(last >= 0, last + 1, lengths.clamp(max=2)).minimum(lengths)
        width = max(int(ends.max()), 1)
        keep = torch.arange(width, device=ends.device) < ends[:, None]
        tensors = {k: torch.where(keep, v[:, :width], 0) for k, v in vars(self).items()
                   if isinstance(v, torch.Tensor) and v.dim() == 2}
        tensors["input_ids"] = torch.where(keep, tensors["input_ids"], self.pad_id)
        return Batch(**tensors, sample_mask=self.sample_mask, hints=self.hints, pad_id=self.pad_id)

    @classmethod
    def from_trajectories(cls, trajectories: list[Trajectory], advantages: list[float], *, pad_id: int,
                          failed: list[bool] | None = None, hints: Sequence[Hint] = (),
                          header_ids: tuple[int, ...] = ()) -> Batch:
        """Pad trajectories into a batch. `header_ids`: the assistant header tokens that end every prompt and
        observation (`ChatFormat.assistant_header_ids`), needed to place hints."""
        if len(advantages) != len(trajectories):
            raise ValueError(f"{len(trajectories)} trajectories but {len(advantages)} advantages")
        failed = failed or [False] * len(trajectories)
        if len(failed) != len(trajectories):
            raise ValueError(f"{len(trajectories)} trajectories but {len(failed)} failure flags")
        if not trajectories:
            raise ValueError("an empty batch: no trajectories")
        length = max(len(t.token_ids()) for t in trajectories)
        shape = (len(trajectories), length)
        input_ids = torch.full(shape, pad_id, dtype=torch.long)
        attention = torch.zeros(shape, dtype=torch.long)
        mask, lps, adv = torch.zeros(shape), torch.zeros(shape), torch.zeros(shape)
        versions = torch.zeros(shape, dtype=torch.long)
        for b, (traj, a) in enumerate(zip(trajectories, advantages, strict=True)):
            ids = traj.token_ids()
            n = len(ids)
            input_ids[b, :n] = torch.tensor(ids)
            attention[b, :n] = 1
            mask[b, :n] = torch.tensor(traj.loss_mask(), dtype=torch.float)
            lps[b, :n] = torch.tensor(traj.sampler_logprobs(), dtype=torch.float)
            adv[b, :n] = a
            pos = len(traj.prompt_ids)
            for turn in traj.turns:
                versions[b, pos:pos + len(turn.completion_ids)] = turn.policy_version
                pos += len(turn.completion_ids) + len(turn.observation_ids)
        sample_mask = torch.tensor([0.0 if f else 1.0 for f in failed])
        targets = [place_hint(trajectories[h.sample], h, header_ids) for h in hints]
        return cls(input_ids, attention, mask, lps, adv, versions, sample_mask, targets, pad_id)


    @classmethod
    def from_rollouts(cls, batch: RolloutBatch, *, pad_id: int, header_ids: tuple[int, ...] = ()) -> Batch:
        """A scheduler's `RolloutBatch` as tensors: one row per rollout in batch order, its advantage on every
        token, `sample_mask` 0 for masked rollouts (no reward), `hints` from the batch's hint slot, and per-token
        versions — `Turn.token_versions` where a completion spanned a weight update, else the turn's version.
        Tokens sampled by a version older than `batch.min_version` get loss mask 0: context, not trained on — by the
        policy loss or by a hint's distillation (a hint's target is cut to its turn's fresh tokens, or dropped)."""
        rollouts = batch.rollouts
        trajectories = [r.trajectory or Trajectory(task=r.task_id, model="", prompt_ids=[]) for r in rollouts]
        out = cls.from_trajectories(trajectories, batch.advantages, pad_id=pad_id,
                                    failed=[m == 0 for m in batch.masks], hints=batch.hints, header_ids=header_ids)
        for b, traj in enumerate(trajectories):
            pos = len(traj.prompt_ids)
            for turn in traj.turns:
                n = len(turn.completion_ids)
                if turn.token_versions:
                    if len(turn.token_versions) != n:
                        raise ValueError(f"rollout {rollouts[b].rollout_id} turn {turn.index}: "
                                         f"{len(turn.token_versions)} token versions for {n} tokens")
                    out.versions[b, pos:pos + n] = torch.tensor(turn.token_versions, dtype=torch.long)
                pos += n + len(turn.observation_ids)
        if batch.min_version is not None:
            fresh = out.versions >= batch.min_version
            out.loss_mask *= fresh.to(out.loss_mask.dtype)
            # a hint distils into the turn's tokens: only into its fresh ones (a suffix: versions grow within a turn)
            kept = []
            for h in out.hints:
                span = fresh[h.sample, h.start:h.end]
                if bool(span.any()):
                    start = h.start + int(span.to(torch.int8).argmax())
                    kept.append(replace(h, start=start))
            out.hints = kept
        return out
