"""TRL's GRPOTrainer side of `shipyard bench trainer`, run by the bench in a venv that has TRL (never imported by
shipyard itself). Trains `--steps` GRPO steps on CPU (float32 weights; `--dtype bfloat16`: TRL's
bf16 mixed precision) and writes, per step, the wall time of the step, the time TRL
spent generating and scoring, the token count of the batch, and the exact sequences (prompt + completion ids and
masks, advantages) so that shipyard's trainer can be timed on the same batches. Prompts are chat requests
(`TASKS`); completions end where the model stops (`--lengths natural`, at most `--completion` tokens) or are forced
to exactly `--completion` tokens (`--lengths fixed`).

    python -m shipyard.bench._trl_grpo --model M --out FILE.pt [--prompts 2 --generations 4 --completion 64 --steps 3]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from shipyard.models.resolve import load_hf

# Coding requests whose answers range from a word to a page, so that completions end where the model stops, as in RL.
TASKS = [
    "What does len([1, 2, 3]) return in Python? Answer with the number only.",
    "Write a Python function that parses an ISO date string like 2024-05-17 and returns (year, month, day).",
    "Which Python keyword defines a function? One word.",
    "Write a Python class Stack with push, pop and peek methods, each with a docstring.",
    "Give a one-line Python expression that reverses a string s.",
    "Explain in two sentences what a Python generator is.",
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a short docstring.",
    "Is a Python tuple mutable? Answer yes or no.",
]


class StepTimer(TrainerCallback):
    def __init__(self):
        self.starts, self.seconds = [], []

    def on_step_begin(self, args, state, control, **kw):
        self.starts.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kw):
        self.seconds.append(time.perf_counter() - self.starts[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--completion", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--lengths", choices=("natural", "fixed"), default="natural")
    args = ap.parse_args()
    torch.manual_seed(0)
    random.seed(0)
    model, tok = load_hf(args.model, dtype=torch.float32)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    n = args.prompts * (args.steps + 1)
    prompts = [[{"role": "user", "content": TASKS[i % len(TASKS)]}] for i in range(n)]
    batch = args.prompts * args.generations
    config = GRPOConfig(output_dir="/tmp/shipyard-bench-trl", per_device_train_batch_size=batch,
                        gradient_accumulation_steps=1, num_generations=args.generations, steps_per_generation=1,
                        num_iterations=1, max_completion_length=args.completion, max_steps=args.steps,
                        learning_rate=args.lr, beta=0.0, loss_type="dapo", use_cpu=True,
                        bf16=args.dtype == "bfloat16",
                        logging_steps=1, report_to="none", save_strategy="no", seed=0,
                        generation_kwargs={"min_new_tokens": args.completion} if args.lengths == "fixed" else {},
                        dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [random.random() for _ in completions],
                          args=config, train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok)
    timer = StepTimer()
    trainer.add_callback(timer)
    generation, batches = [], []
    original = trainer._generate_and_score_completions

    def timed(*a, **kw):
        t = time.perf_counter()
        out = original(*a, **kw)
        generation.append(time.perf_counter() - t)
        batches.append({k: out[k].detach().cpu() for k in ("prompt_ids", "prompt_mask", "completion_ids",
                                                            "completion_mask", "advantages")})
        return out

    trainer._generate_and_score_completions = timed
    trainer.train()
    torch.save({"step_seconds": timer.seconds, "generation_seconds": generation, "batches": batches,
                "pad_id": tok.pad_token_id, "threads": torch.get_num_threads()}, args.out)


if __name__ == "__main__":
    main()
