"""``trainer.sample_prompts``: the model's greedy answers to a few prompts, at each validation (at
the end of training where the run does not validate), to read while it trains.

Every rank runs the same forward passes (the model is sharded: each pass gathers its weights), the
whole sequence each step without a key/value cache (a few short answers; nothing else of the run's
model has to change for it); rank 0's choice of each token is broadcast, so all ranks stop
together. Rank 0 writes ``samples/step_N.jsonl`` in the run folder (one line a prompt, as
``fsdp-generate --out`` writes them) and hands the rows to the loggers that take tables or text:
W&B (``log_text``), MLflow (an artifact ``samples/step_N.json`` in ``log_table``'s layout), TensorBoard
(``add_text``). Training is not changed: the model goes back to training mode and no gradient is
kept.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch

SAMPLES_DIR = "samples"


class SampleAnswers(L.Callback):
    """Arguments:
    prompts: (``file:line``, the prompt as shown, its token ids) of each prompt.
    decode: the answer's text from its token ids (rank 0 only).
    eos: token ids that end an answer.
    max_new_tokens: the longest answer.
    context: the longest sequence the model takes.
    folder: where ``step_N.jsonl`` files go.
    """

    def __init__(
        self,
        prompts: Sequence[tuple[str, Any, list[int]]],
        *,
        decode: Callable[[list[int]], str],
        eos: frozenset[int],
        max_new_tokens: int,
        context: int,
        folder: Path,
    ) -> None:
        self.prompts = list(prompts)
        self.decode = decode
        self.eos = eos
        self.max_new_tokens = max_new_tokens
        self.context = context
        self.folder = Path(folder)
        self.sampled_steps: set[int] = set()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.sample(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step not in self.sampled_steps:
            self.sample(trainer, pl_module)

    def sample(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        step = trainer.global_step
        self.sampled_steps.add(step)
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                answers = [self.answer(trainer, module, ids) for _, _, ids in self.prompts]
        finally:
            module.train(was_training)
        if trainer.is_global_zero:
            rows = [
                {
                    "step": step,
                    "where": where,
                    "prompt": shown,
                    "answer": self.decode(tokens),
                    "new_tokens": len(tokens),
                }
                for (where, shown, _), tokens in zip(self.prompts, answers, strict=True)
            ]
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self.folder / f"step_{step:08d}.jsonl"
            path.write_text(
                "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8"
            )
            log_rows(trainer.loggers, rows, step)

    def answer(self, trainer: L.Trainer, module: L.LightningModule, ids: list[int]) -> list[int]:
        """Greedy tokens after ``ids``, rank 0's choice of each one on every rank."""
        out: list[int] = []
        sequence = list(ids)
        while len(out) < self.max_new_tokens and len(sequence) < self.context:
            logits = module(torch.tensor([sequence], device=module.device))
            token = int(trainer.strategy.broadcast(int(logits[0, -1].argmax()), src=0))
            out.append(token)
            sequence.append(token)
            if token in self.eos:
                break
        return out


def log_rows(loggers: Sequence[Any], rows: list[dict[str, Any]], step: int) -> None:
    """The rows to each logger that takes them: a table (W&B, MLflow) or text (TensorBoard)."""
    columns = ["step", "prompt", "answer"]
    table = [[row["step"], json.dumps(row["prompt"], ensure_ascii=False), row["answer"]] for row in rows]
    for logger in loggers:
        kind = type(logger).__name__
        if kind == "WandbLogger":
            logger.log_text(key=SAMPLES_DIR, columns=columns, data=table, step=step)
        elif kind == "MLFlowLogger":  # log_table's layout, without the pandas log_table needs
            logger.experiment.log_dict(
                logger.run_id, {"columns": columns, "data": table}, f"{SAMPLES_DIR}/step_{step:08d}.json"
            )
        elif kind == "TensorBoardLogger":
            text = "\n\n".join(f"**{prompt}**\n\n{answer}" for _, prompt, answer in table)
            logger.experiment.add_text(SAMPLES_DIR, text, global_step=step)
