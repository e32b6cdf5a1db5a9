"""Lightning callbacks, loggers and epochs from the config (issue 17 §3).

``+callbacks.NAME._target_=...`` entries run beside fsdp-train's own callbacks and see
metrics.jsonl's values; Lightning's ModelCheckpoint saves in our format and its files resume;
``logger=mlflow``/``wandb`` receive metrics.jsonl's values (read back from MLflow's store and the
W&B run file); ``trainer.max_epochs`` ends runs on our data and on a module's own loaders, and a
run resumed mid-epoch repeats the uninterrupted one's losses exactly."""

from __future__ import annotations

import json
import os
import signal
import struct
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_ok, cli_in_process, composed, read_metrics, run_cli, run_of

from fsdp_cli.errors import ConfigError

CPU = {"CUDA_VISIBLE_DEVICES": ""}
TWO_CPU = ["accelerator=cpu", "devices=2", "precision=32-true", "data.global_batch_size=8", "data.seq_len=32"]
CB = "lightning.pytorch.callbacks"
LR_MONITOR = [f"+callbacks.lr._target_={CB}.LearningRateMonitor"]
# val_loss never improves by 10: patience 2 stops the run at its third validation (step 6 of 12).
EARLY_STOP = [
    f"+callbacks.stop._target_={CB}.EarlyStopping",
    "+callbacks.stop.monitor=val_loss",
    "+callbacks.stop.min_delta=10",
    "+callbacks.stop.patience=2",
]


def model_checkpoint(dirpath: Path) -> list[str]:
    """Lightning's ModelCheckpoint on metrics.jsonl's ``loss``, every 2 steps, every file kept."""
    return [
        f"+callbacks.best._target_={CB}.ModelCheckpoint",
        "+callbacks.best.monitor=loss",
        "+callbacks.best.every_n_train_steps=2",
        "+callbacks.best.save_top_k=-1",
        f"+callbacks.best.dirpath={dirpath}",
        "+callbacks.best.filename='{step}-{loss:.6f}'",
    ]


def callback_run_args(run_dir: Path) -> list[str]:
    return [
        *TWO_CPU,
        "trainer.max_steps=12",
        "trainer.val_check_interval=2",
        "logger=mlflow",
        *LR_MONITOR,
        *EARLY_STOP,
        *model_checkpoint(run_dir / "best"),
    ]


# Our data with epochs: 80 sequences / 8 per step = 10 steps an epoch, 2 epochs, no step limit.
EPOCH_RUN = [
    *TWO_CPU,
    "data.num_sequences=80",
    "trainer.max_epochs=2",
    "trainer.max_steps=-1",
    "checkpoint.every_n_steps=4",
    "checkpoint.keep_last=5",
    "optim.scheduler=cosine",
    "logger=wandb",
]
# A module's own resumable loader: 3 steps an epoch on 2 ranks; max_steps=8 comes before 3 epochs.
OWN_EPOCH_RUN = [
    "accelerator=cpu",
    "devices=2",
    "precision=32-true",
    "strategy=ddp",
    "model=custom",
    "model._target_=tests.assets.epoch_loaders.ResumableLoaderLM",
    "trainer.max_epochs=3",
    "trainer.max_steps=8",
    "checkpoint.every_n_steps=2",
    "checkpoint.keep_last=5",
]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``runs(name)`` -> (run dir, stderr), each run started once, on first use."""
    root = tmp_path_factory.mktemp("cb_log_epochs")
    done: dict[str, tuple[Path, str]] = {}

    def args_of(name: str, run_dir: Path) -> list[str]:
        if name == "callbacks":
            return callback_run_args(run_dir)
        if name == "callbacks_resumed":  # from Lightning's ModelCheckpoint file of step 4
            first, _ = get("callbacks")
            (saved,) = (first / "best").glob("step=4-*.ckpt")
            return [*callback_run_args(run_dir), f"resume='{saved}'"]
        if name == "epochs":
            return EPOCH_RUN
        if name == "own_epochs":
            return OWN_EPOCH_RUN
        assert name == "own_epochs_resumed"
        return [*OWN_EPOCH_RUN, f"resume={get('own_epochs')[0] / 'checkpoints' / 'step_00000004'}"]

    def get(name: str) -> tuple[Path, str]:
        if name not in done:
            run_dir = root / name
            if name == "epochs_preempted":
                done[name] = preempted_then_resumed(run_dir)
                return done[name]
            result = run_cli(args_of(name, run_dir), run_dir, env=CPU)
            assert_ok(result, run_dir)
            done[name] = (run_dir, result.stderr)
        return done[name]

    return get


# --------------------------------------------------------------------------- callbacks (2 ranks)


@pytest.mark.distributed
def test_early_stopping_on_val_loss_stops_the_run(runs: Any) -> None:
    run_dir, _ = runs("callbacks")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6, summary  # of trainer.max_steps=12: validations at 2, 4, 6
    assert [r["step"] for r in read_metrics(run_dir) if "val_loss" in r] == [2, 4, 6]
    assert max(train_losses(run_dir)) == 6


@pytest.mark.distributed
def test_metrics_jsonl_values_and_the_lr_monitor_reach_mlflow(runs: Any) -> None:
    from mlflow.tracking import MlflowClient

    run_dir, _ = runs("callbacks")
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("fsdp-train")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == run_dir.name and run.info.status == "FINISHED"

    def history(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}

    rows = [r for r in read_metrics(run_dir) if "loss" in r]
    for key in ("loss", "lr", "step_time_s", "tokens_per_s", "grad_norm"):
        assert history(key) == {r["step"]: r[key] for r in rows}, key
    # val_loss reaches the logger from the module's self.log, through Lightning, at Lightning's step
    # for it (the optimizer steps taken before the validated one), in float32.
    val = {r["step"] - 1: r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r}
    assert history("val_loss") == pytest.approx(val, rel=1e-6)
    assert set(history("lr-AdamW").values()) == {rows[0]["lr"]}  # LearningRateMonitor's own key
    assert "mfu" not in run.data.metrics  # null on CPU: loggers get numbers only


@pytest.mark.distributed
def test_model_checkpoint_monitors_loss_and_its_files_resume_exactly(runs: Any, capsys: Any) -> None:
    """ModelCheckpoint(monitor="loss") sees metrics.jsonl's loss; its files are fsdp-train
    checkpoints (verify, inspect) and ``resume=`` one of them continues with the same losses."""
    from fsdp_cli.cli.ckpt import main as ckpt_main

    run_dir, _ = runs("callbacks")
    losses = train_losses(run_dir)
    saved = {int(p.name.split("-")[0].removeprefix("step=")): p for p in (run_dir / "best").glob("*.ckpt")}
    assert sorted(saved) == [2, 4, 6]
    for step, path in saved.items():
        assert path.name == f"step={step}-loss={losses[step]:.6f}.ckpt"
    with pytest.raises(SystemExit) as verified:
        ckpt_main(["verify", str(saved[4])])
    assert verified.value.code == 0
    ckpt_main(["inspect", str(saved[4]), "--json"])
    out = capsys.readouterr().out
    info = json.loads(out[out.index("{") :])
    assert (info["step"], info["format"]) == (4, "sharded")

    resumed, stderr = runs("callbacks_resumed")
    assert f"resuming from {saved[4]} (step 4)" in stderr
    again = train_losses(resumed)
    assert min(again) == 5
    assert {s: again[s] for s in (5, 6)} == {s: losses[s] for s in (5, 6)}


# --------------------------------------------------------------------------- epochs (2 ranks)


@pytest.mark.distributed
def test_epochs_of_our_data_end_the_run_and_wandb_offline_gets_every_row(runs: Any) -> None:
    """2 epochs of 10 steps with trainer.max_steps=-1: 20 steps; the cosine schedule reaches its
    floor exactly where the epochs end; W&B, offline, holds every metrics.jsonl row."""
    run_dir, _ = runs("epochs")
    rows = [r for r in read_metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert rows[-1]["lr"] == pytest.approx(3e-3 * 0.1)  # lr * min_lr_ratio at the horizon
    assert rows[-2]["lr"] > rows[-1]["lr"] * 1.01
    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history = [h for h in wandb_history(run_file) if "loss" in h]
    assert [(h["trainer/global_step"], h["loss"], h["lr"]) for h in history] == [
        (r["step"], r["loss"], r["lr"]) for r in rows
    ]


def preempted_then_resumed(run_dir: Path) -> tuple[Path, str]:
    """EPOCH_RUN stopped in epoch 0 by SIGUSR1 to rank 1 (as a scheduler signals before a time
    limit), then ``resume=auto``: (run dir, the resumed run's stderr). The stopped run must exit
    as preempted (143) after step 3 and before epoch 0 ends (step 10)."""
    from conftest import complete_lines, start_cli, wait_for

    from fsdp_cli.rundir.heartbeat import read_heartbeats

    proc = start_cli(EPOCH_RUN, run_dir, env=CPU)
    wait_for(lambda: len(complete_lines(run_dir / "metrics.jsonl")) >= 3, proc)
    os.kill(read_heartbeats(run_dir)[1].pid, signal.SIGUSR1)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    stopped = json.loads((run_dir / "summary.json").read_text())["steps"]
    assert 3 <= stopped < 10, stopped  # mid-epoch 0
    (run_dir / "stopped_at").write_text(str(stopped))
    resumed = run_cli([*EPOCH_RUN, "resume=auto"], run_dir, env=CPU)
    assert_ok(resumed, run_dir)
    return run_dir, resumed.stderr


@pytest.mark.distributed
def test_our_data_resumed_mid_epoch_repeats_the_uninterrupted_losses(runs: Any) -> None:
    """Resumed from the preemption's save in epoch 0: the steps after it (the rest of epoch 0,
    then epoch 1) are bitwise the uninterrupted run's (the same layout)."""
    straight, _ = runs("epochs")
    resumed, stderr = runs("epochs_preempted")
    stopped = int((resumed / "stopped_at").read_text())
    assert f"resuming from {resumed / 'checkpoints' / f'step_{stopped:08d}'}" in stderr, stderr[-2000:]
    assert "not resumable" not in stderr
    expected = train_losses(straight)
    after = {s: loss for s, loss in train_losses(resumed).items() if s > stopped}
    assert after == {s: expected[s] for s in range(stopped + 1, 21)}


@pytest.mark.distributed
def test_preempted_mid_epoch_then_resumed_ends_like_the_uninterrupted_run(runs: Any) -> None:
    """A stop signal in epoch 0: the run saves and exits as preempted; ``resume=auto``
    continues to the same end, step 20, with every step's loss the uninterrupted run's (the
    epoch it was stopped in is not counted as finished)."""
    straight, _ = runs("epochs")
    run_dir, _ = runs("epochs_preempted")
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 20
    assert train_losses(run_dir) == train_losses(straight)


@pytest.mark.distributed
def test_own_loader_epochs_with_max_steps_first_resume_mid_epoch_exactly(runs: Any) -> None:
    """A module's own DataLoader, 3 steps an epoch: trainer.max_steps=8 comes before 3 epochs
    (Lightning's rule). Resumed at step 4, the first of epoch 1, through the loader's
    state_dict / load_state_dict, steps 5-8 (into epoch 2) repeat the uninterrupted run's losses."""
    straight, _ = runs("own_epochs")
    losses = train_losses(straight)
    assert sorted(losses) == list(range(1, 9))
    assert json.loads((straight / "summary.json").read_text())["steps"] == 8
    resumed, stderr = runs("own_epochs_resumed")
    assert "not resumable" not in stderr
    assert train_losses(resumed) == {s: losses[s] for s in range(5, 9)}


def wandb_history(path: Path) -> list[dict[str, Any]]:
    """The history rows of a W&B run file: a LevelDB-style log (a 7-byte ``:W&B`` header, then
    32 KiB blocks of records, each a 7-byte header: checksum, length, kind: 1 whole, 2-4 first,
    middle, last piece) of ``wandb_internal_pb2.Record`` protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    rows, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append(
                    {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in items}
                )
    return rows


# --------------------------------------------------------------------------- one-line errors


ERROR_CASES = [
    # Found without importing the module (config/validate.py).
    (
        [f"+callbacks.lr._target_=no_such_pkg.{'Monitor'}"],
        "callbacks.lr._target_=no_such_pkg.Monitor",
        ["cannot be imported"],
    ),
    (["+callbacks.lr=5"], "callbacks.lr=5", ["needs the class to build", "_target_"]),
    (["trainer.max_steps=-1"], "trainer.max_steps=-1", ["would never end", "trainer.max_epochs=N"]),
    (["trainer.max_epochs=0"], "trainer.max_epochs=0", ["must be at least 1", "or null"]),
    (["trainer.max_epochs=2"], "data.num_sequences=null", ["endless stream", "hint: data.num_sequences=800"]),
    (
        ["trainer.max_epochs=2", "data.num_sequences=4"],
        "data.num_sequences=4",
        ["at least one global batch (data.global_batch_size=8)"],
    ),
    # Found by importing it, on the resolve path (config/callback_classes.py).
    (
        [f"+callbacks.lr._target_={CB}.NoSuchMonitor"],
        f"callbacks.lr._target_={CB}.NoSuchMonitor",
        ["has no attribute 'NoSuchMonitor'", "EarlyStopping"],
    ),
    (
        ["+callbacks.od._target_=collections.OrderedDict"],
        "callbacks.od._target_=collections.OrderedDict",
        ["not a Lightning Callback"],
    ),
    (
        [f"+callbacks.stop._target_={CB}.EarlyStopping", "+callbacks.stop.monitr=val_loss"],
        "callbacks.stop.monitr=val_loss",
        [
            "EarlyStopping takes no argument 'monitr'",
            "allowed: monitor, min_delta",
            "hint: did you mean callbacks.stop.monitor?",
        ],
    ),
    (
        [f"+callbacks.stop._target_={CB}.EarlyStopping"],
        f"callbacks.stop={CB}.EarlyStopping",
        ["missing a required argument: 'monitor'", "hint: +callbacks.stop.monitor=VALUE"],
    ),
    (LR_MONITOR, f"callbacks.lr._target_={CB}.LearningRateMonitor", ["logger=none", "hint: add logger=csv"]),
]


@pytest.mark.parametrize(
    ("overrides", "key", "words"), ERROR_CASES, ids=[" ".join(c[0]) for c in ERROR_CASES]
)
def test_mistakes_are_one_line_before_launch(
    tmp_path: Path, overrides: list[str], key: str, words: list[str]
) -> None:
    run_dir = tmp_path / "run"
    result = cli_in_process(["accelerator=cpu", *overrides], run_dir, env=CPU)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"fsdp-train: error: {key}"), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    leftovers = sorted(p.name for p in run_dir.iterdir()) if run_dir.exists() else []
    assert set(leftovers) <= {".hydra", "train.log"}, leftovers  # no rank started


@pytest.mark.distributed
def test_callback_modules_are_found_without_importing_torch(tmp_path: Path) -> None:
    """A config error after the callbacks were checked: lightning.pytorch.callbacks was found
    (else the error would be about it), and neither torch nor lightning was imported."""
    result = run_cli(
        [*LR_MONITOR, "data.global_batch_size=7", "devices=2", "accelerator=cpu"],
        tmp_path / "run",
        env={**CPU, "PYTHONPROFILEIMPORTTIME": "1"},
        timeout=60,
    )
    assert result.returncode == 2 and "data.global_batch_size=7" in result.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line}
    assert imported and "torch" not in imported and "lightning" not in imported


@pytest.mark.parametrize(("logger", "extra"), [("mlflow", "mlflow"), ("wandb", "wandb")])
def test_a_missing_logger_package_names_its_extra(monkeypatch: Any, logger: str, extra: str) -> None:
    import importlib.util

    from fsdp_cli.config.validate import check_experiment_logger
    from fsdp_cli.extras import install_hint

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == extra else real(name, *a)
    )
    with pytest.raises(ConfigError) as info:
        check_experiment_logger(run_of(composed(f"logger={logger}")))
    assert info.value.one_line() == (
        f"logger={logger}: the {extra} package is not installed; allowed: none, csv; "
        f"hint: {install_hint(extra)}"
    )


def test_both_limits_get_a_note_saying_which_wins() -> None:
    from fsdp_cli.config.validate import advisories

    notes = advisories(composed("trainer.max_epochs=2", "data.num_sequences=16"))
    assert any("whichever comes first" in n and "trainer.max_steps=-1" in n for n in notes), notes
    assert not any("max_epochs" in n for n in advisories(composed()))


# --------------------------------------------------------------------------- epochs of our data


def _epoch_batches(sampler: Any, current: int) -> list[list[int]]:
    sampler.current_step = lambda: current
    return list(iter(sampler))


@pytest.mark.parametrize(("dp", "micro"), [(1, 8), (2, 2), (4, 1)])
def test_an_epoch_is_whole_global_batches_and_resumes_at_any_step(dp: int, micro: int) -> None:
    """26 items, 8 per step: 3 steps an epoch (2 items left out); every rank's micro-batches of
    epoch e cover items e*26 .. e*26+23 once; a pass started mid-epoch is the rest of that epoch."""
    from fsdp_cli.data.sampler import StepBatchSampler

    samplers = [
        StepBatchSampler(global_batch_size=8, micro_batch_size=micro, dp_rank=r, dp_size=dp, epoch_size=26)
        for r in range(dp)
    ]
    assert samplers[0].steps_per_epoch == 3 and len(samplers[0]) == 3 * (8 // dp // micro)
    for epoch in (0, 1, 2):
        items = sorted(i for s in samplers for batch in _epoch_batches(s, epoch * 3) for i in batch)
        assert items == list(range(epoch * 26, epoch * 26 + 24))
    for sampler in samplers:
        whole = _epoch_batches(sampler, 3)  # epoch 1 from its start
        per_step = len(whole) // 3
        assert _epoch_batches(sampler, 4) == whole[per_step:]  # resumed after its first step
        assert _epoch_batches(sampler, 5) == whole[2 * per_step :]


def test_endless_sampler_has_no_length_and_never_stops() -> None:
    from fsdp_cli.data.sampler import StepBatchSampler

    sampler = StepBatchSampler(global_batch_size=4, micro_batch_size=4, dp_rank=0, dp_size=1)
    with pytest.raises(TypeError):
        len(sampler)
    batches = iter(sampler)
    assert [next(batches) for _ in range(50)][-1] == list(range(196, 200))


def test_each_dataset_visits_every_item_once_per_epoch_in_a_new_order(tmp_path: Path) -> None:
    import numpy as np
    import torch

    from fsdp_cli.data.synthetic import SyntheticTokens
    from fsdp_cli.data.text import ByteWindows
    from fsdp_cli.data.tokens import TokenWindows

    (tmp_path / "t.bin").write_bytes(np.arange(801, dtype=np.uint16).tobytes())
    tokens = TokenWindows([tmp_path / "t.bin"], dtype="uint16", seq_len=16, seed=5)
    corpus = torch.randint(256, (801,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    text = ByteWindows(corpus, seq_len=16, seed=5)
    synthetic = SyntheticTokens(vocab_size=256, seq_len=16, seed=5, num_sequences=50)
    endless = SyntheticTokens(vocab_size=256, seq_len=16, seed=5)
    assert tokens.epoch_size == text.epoch_size == 50 and synthetic.epoch_size == 50
    assert endless.epoch_size is None
    for data in (tokens, text, synthetic):
        epochs = [[tuple(data[e * 50 + i].tolist()) for i in range(50)] for e in (0, 1)]
        assert len(set(epochs[0])) == 50 and set(epochs[0]) == set(epochs[1]), type(data).__name__
        assert epochs[0] != epochs[1], "a new order each epoch"
    windows = {tuple(corpus[16 * w : 16 * w + 17].tolist()) for w in range(50)}
    assert {tuple(text[i].tolist()) for i in range(50)} == windows  # they tile the text
    assert {tuple(synthetic[i].tolist()) for i in range(50)} == {
        tuple(endless[i].tolist()) for i in range(50)
    }


# --------------------------------------------------------------------------- metrics for callbacks


def test_callbacks_monitor_the_metrics_rows_in_process(tmp_path: Path) -> None:
    """One process, Lightning's own Trainer: EarlyStopping(monitor="loss") and
    ModelCheckpoint(monitor="grad_norm") run on the metrics callback's values (without them in
    ``callback_metrics`` both raise); a name the module logs itself stays the module's."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    from fsdp_cli.callbacks.clipping import GradientClipping
    from fsdp_cli.callbacks.metrics import MetricsCallback

    class LogsStepTime(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("step_time_s", -1.0)
            return super().training_step(batch, batch_idx)

    clipping = GradientClipping(100.0, "norm")
    metrics = MetricsCallback(
        tmp_path, log_every_n_steps=2, tokens_per_step=None, max_steps=-1, clipping=clipping
    )
    stop = EarlyStopping(monitor="loss", min_delta=1e9, patience=1, check_on_train_epoch_end=True)
    best = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", monitor="grad_norm", every_n_train_steps=2, save_top_k=1
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=5,
        limit_train_batches=4,
        limit_val_batches=0,
        callbacks=[clipping, metrics, stop, best],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(LogsStepTime())
    assert trainer.global_step == 8  # epoch 0 sets the best, epoch 1 does not beat it by 1e9: stop
    rows = {r["step"]: r for r in metrics.rows}
    assert sorted(rows) == [2, 4, 6, 8]
    assert float(stop.best_score) == rows[4]["loss"]  # epoch 0's last logged loss
    assert float(best.best_model_score) == min(r["grad_norm"] for r in rows.values())
    assert float(trainer.callback_metrics["step_time_s"]) == -1.0
    shared = {k: v for k, v in trainer.callback_metrics.items() if k in rows[8] and k != "step_time_s"}
    assert sorted(shared) == ["grad_norm", "loss", "lr", "samples_per_s"], sorted(shared)
    assert all(v.dtype == torch.float64 and v.shape == () for v in shared.values()), shared
    assert {k: float(v) for k, v in shared.items()} == {k: rows[8][k] for k in shared}


def test_the_ranks_build_entries_with_hydra_and_a_refused_value_is_one_line() -> None:
    """What the ranks build: keyword arguments, a nested ``_target_`` argument built too, null
    entries skipped; a value the constructor refuses is a ConfigError naming the entry."""
    from lightning.pytorch.callbacks import EarlyStopping, RichProgressBar

    from fsdp_cli.builders.callbacks import build_user_callbacks

    cfg = composed(
        f"+callbacks.stop._target_={CB}.EarlyStopping",
        "+callbacks.stop.monitor=loss",
        "+callbacks.stop.patience=7",
        f"+callbacks.bar._target_={CB}.RichProgressBar",
        f"+callbacks.bar.theme._target_={CB}.progress.rich_progress.RichProgressBarTheme",
        "+callbacks.bar.theme.description=green",
        "+callbacks.off=null",
    )
    stop, bar = build_user_callbacks(cfg)
    assert isinstance(stop, EarlyStopping) and (stop.monitor, stop.patience) == ("loss", 7)
    assert isinstance(bar, RichProgressBar) and bar.theme.description == "green"
    bad = composed(
        f"+callbacks.stop._target_={CB}.EarlyStopping",
        "+callbacks.stop.monitor=loss",
        "+callbacks.stop.mode=sideways",
    )
    with pytest.raises(ConfigError) as info:
        build_user_callbacks(bad)
    line = info.value.one_line()
    assert line.startswith(f"callbacks.stop={CB}.EarlyStopping: MisconfigurationException: ")
    assert "sideways" in line and "\n" not in line
