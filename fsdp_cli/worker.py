"""One rank of a run: read the resolved config, build, fit, write the outputs.

Started by torch.distributed.run as ``python -m fsdp_cli.worker <run_dir>/config.yaml``, or
called in-process by the entry point when it already is a torchrun/SLURM rank. Rank 0 writes
``metrics.jsonl`` and ``summary.json`` (also when the run fails); the other ranks' console
output goes to ``<run_dir>/logs/rank<N>.log``.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from fsdp_cli.config.convert import load_train_config
from fsdp_cli.config.errors import EXIT_CONFIG_ERROR, ConfigError
from fsdp_cli.config.schema import CustomModelConfig, TrainConfig
from fsdp_cli.report import (
    EXIT_PREEMPTED,
    STATUS_FAILED,
    STATUS_OK,
    STATUS_PREEMPTED,
    SUMMARY_FILE,
    global_rank,
    median_of,
    steady_state,
    write_summary,
)

LOG_DIR = "logs"


def run(cfg: TrainConfig) -> int:
    """Train as this rank; returns the process exit status."""
    run_dir = Path(cfg.run_dir)
    rank = global_rank()
    if rank != 0:
        _redirect_output(run_dir / LOG_DIR / f"rank{rank}.log")
    started = time.time()
    state: dict[str, Any] = {}
    status, error, code = STATUS_OK, None, 0
    try:
        _fit(cfg, state)
        if state.get("preempted"):
            status, error, code = (
                STATUS_PREEMPTED,
                "stopped by SIGTERM after saving a checkpoint",
                EXIT_PREEMPTED,
            )
    except ConfigError as err:
        status, error, code = STATUS_FAILED, err.one_line(), EXIT_CONFIG_ERROR
        print(f"fsdp-train: error: {error}", file=sys.stderr, flush=True)
    except Exception as err:  # noqa: BLE001 - reported in summary.json, then re-raised as exit 1
        status, error, code = STATUS_FAILED, f"{type(err).__name__}: {err}", 1
        traceback.print_exc()
    summary = _summary(cfg, state, status=status, error=error, wall=time.time() - started)
    summary["exit_code"] = code
    # Rank 0 writes the summary. When a run fails, another rank may get there first (and rank 0
    # may be stopped by the launcher before it can), so a failing rank writes one if none exists.
    if rank == 0 or (code != 0 and not (run_dir / SUMMARY_FILE).exists()):
        write_summary(run_dir, summary)
    return code


def _quiet_known_noise() -> None:
    """Silence messages that are noise for our own code paths, so real warnings stand out:
    Lightning's start-up banners and tips; FSDP2's note that the root returns a view (our loss
    never modifies logits in place); DTensor's note that the scalar gradient-norm all-reduce on
    the (dp, tp) mesh takes two collectives instead of one."""
    import logging
    import warnings

    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*is deprecated")
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    warnings.filterwarnings("ignore", message=r"You defined a `validation_step` but have no `val_dataloader`")

    class _NormPartialNote(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "_NormPartial" not in record.getMessage()

    logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_NormPartialNote())


def _fit(cfg: TrainConfig, state: dict[str, Any]) -> None:
    import lightning as L

    _quiet_known_noise()
    from fsdp_cli.build.model import build_module
    from fsdp_cli.build.strategy import build_strategy
    from fsdp_cli.build.trainer import build_trainer
    from fsdp_cli.checkpoint.callback import CheckpointCallback
    from fsdp_cli.checkpoint.run import checkpoint_dir
    from fsdp_cli.clipping import GradientClipping
    from fsdp_cli.config.convert import to_container
    from fsdp_cli.data.datamodule import TokenDataModule, ValidatedTokenDataModule
    from fsdp_cli.metrics import MetricsCallback
    from fsdp_cli.setup_report import SetupReport

    L.seed_everything(cfg.seed, workers=True, verbose=False)
    module = build_module(cfg)
    data_cls = TokenDataModule if cfg.trainer.val_check_interval is None else ValidatedTokenDataModule
    datamodule = data_cls(cfg.data, seed=cfg.seed, dp_size=int(cfg.dp))
    strategy = build_strategy(cfg)
    strategy.checkpoint_manifest = {"config": to_container(cfg), "dp": int(cfg.dp), "tp": cfg.tp}
    metrics = MetricsCallback(
        Path(cfg.run_dir),
        log_every_n_steps=cfg.trainer.log_every_n_steps,
        tokens_per_step=cfg.data.global_batch_size * cfg.data.seq_len,
        max_steps=cfg.trainer.max_steps,
    )
    checkpoints = CheckpointCallback(cfg.checkpoint, checkpoint_dir(cfg), cfg.trainer.max_steps)
    setup = SetupReport()
    state.update(metrics=metrics, setup=setup, checkpoints=checkpoints, module=module)
    callbacks: list[L.Callback] = [setup, metrics, checkpoints]
    if cfg.trainer.gradient_clip_val is not None:
        clipping = GradientClipping(cfg.trainer.gradient_clip_val, cfg.trainer.gradient_clip_algorithm)
        metrics.clipping = clipping
        callbacks.insert(0, clipping)
    trainer = build_trainer(cfg, strategy, callbacks=callbacks, accumulation=datamodule.accumulation)
    checkpoints.install_signal_handler()
    trainer.fit(module, datamodule=datamodule, ckpt_path=_resume_path(cfg))
    state["steps"] = trainer.global_step
    last = checkpoints.last_saved
    already_saved = last is not None and last.name.startswith(f"step_{trainer.global_step:08d}")
    if (cfg.checkpoint.save_last or checkpoints.preempted) and not already_saved:
        checkpoints.save(trainer)
    state["checkpoint"] = str(checkpoints.last_saved) if checkpoints.last_saved else None
    state["preempted"] = checkpoints.preempted


def _resume_path(cfg: TrainConfig) -> str | None:
    """The parent resolved ``resume``; after an elastic restart the newest checkpoint wins."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        from fsdp_cli.checkpoint.run import checkpoint_dir, complete_checkpoints

        found = complete_checkpoints(checkpoint_dir(cfg))
        if found:
            return str(found[-1][1])
    return cfg.resume


def _summary(
    cfg: TrainConfig, state: dict[str, Any], *, status: str, error: str | None, wall: float
) -> dict[str, Any]:
    metrics = state.get("metrics")
    rows = metrics.rows if metrics is not None else []
    steady = steady_state(rows)
    model = cfg.model
    return {
        "status": status,
        "error": error,
        "strategy": cfg.strategy.name,
        "accelerator": cfg.accelerator.value,
        "world_size": int(cfg.devices) * cfg.num_nodes,
        "dp": int(cfg.dp),
        "tp": cfg.tp,
        "precision": cfg.precision.name,
        "model": model.target if isinstance(model, CustomModelConfig) else model.name,
        "parameters": _parameter_count(state.get("module")),
        "global_batch_size": cfg.data.global_batch_size,
        "seq_len": cfg.data.seq_len,
        "steps": state.get("steps", rows[-1]["step"] if rows else 0),
        "final_loss": rows[-1]["loss"] if rows else None,
        "tokens_per_s": median_of(steady, "tokens_per_s"),
        "step_time_s": median_of(steady, "step_time_s"),
        "peak_memory_bytes": metrics.peak_memory_bytes if metrics is not None else [],
        "checkpoint": state.get("checkpoint"),
        "setup": state["setup"].info if state.get("setup") is not None else None,
        "wall_time_s": round(wall, 3),
        "run_dir": str(cfg.run_dir),
    }


def _parameter_count(module: Any) -> int | None:
    if module is None:
        return None
    counted = getattr(module, "num_parameters", None)
    if counted is not None:
        return int(counted)
    return int(sum(p.numel() for p in module.parameters()))


def _redirect_output(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m fsdp_cli.worker RUN_DIR/config.yaml", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    cfg = load_train_config(args[0])
    code = record(run)(cfg)
    # Everything is written and flushed by now (metrics, summary, checkpoints are closed or
    # fsynced). Skipping the interpreter's teardown of torch, gloo and Lightning saves over a
    # second per rank, which every run and every test pays.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
