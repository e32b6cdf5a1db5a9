"""What ``resume`` means for this run, decided in the parent before any rank starts.

``resume=auto`` becomes the newest complete checkpoint of ``checkpoint.dir`` (default
``<run dir>/checkpoints``) that passes :func:`~fsdp_cli.checkpoint.verify.verify_checkpoint`
(newer damaged ones are skipped with a notice saying why), or null; a path must pass it too. The
checkpoint's manifest is compared with the new config: changed layout, precision or training
settings are listed and the run proceeds (sharded checkpoints reshard on load); a different
model shape stops the run with the keys that differ.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fsdp_cli.checkpoint.format import CheckpointFormatError, UnsafeCheckpointError, read_manifest
from fsdp_cli.checkpoint.run import RUN_ID_KEY, checkpoint_dir, new_run_id, newest_verified
from fsdp_cli.checkpoint.verify import verify_checkpoint
from fsdp_cli.config.convert import to_container
from fsdp_cli.config.schema import TrainConfig
from fsdp_cli.errors import ConfigError

# Keys whose change makes the saved tensors unusable (shapes, or a different model altogether).
SHAPE_KEYS = (
    "model.name",
    "model._target_",
    "model.vocab_size",
    "model.dim",
    "model.n_layers",
    "model.n_heads",
    "model.n_kv_heads",
    "model.ffn_hidden_dim",
    "model.multiple_of",
    "model.tie_embeddings",
    "model.n_experts",
    "model.moe_hidden_dim",
    "model.shared_experts",
)
# Keys that differ between any two runs and say nothing about compatibility.
IGNORED = (
    "run_dir",
    "run_id",
    "resume",
    "checkpoint.dir",
    "launcher.",
    "sweep.",
    "explicit_data",
    "start_from",
)


def resolve_resume(cfg: TrainConfig) -> tuple[TrainConfig, list[str]]:
    """The config with ``resume`` made concrete (a path or None) and its ``run_id`` set (the
    resumed checkpoint's, else a new one), and notices for the user."""
    if cfg.resume is None:
        return _with_run_id(cfg, None), []
    notices: list[str] = []
    if cfg.resume == "auto":
        found, notices = _checked("auto", lambda _: newest_verified(checkpoint_dir(cfg)))
        if found is None:
            what = "no intact checkpoint" if notices else "no checkpoint"
            return _with_run_id(dataclasses.replace(cfg, resume=None), None), [
                *notices,
                f"note: resume=auto: {what} in {checkpoint_dir(cfg)}; starting fresh",
            ]
        path = str(found)
    else:
        path = str(cfg.resume)
        _checked(path, verify_checkpoint)
    from fsdp_cli.checkpoint.untrusted import check_checkpoint  # (torch: only where there is a checkpoint)

    _checked(path, check_checkpoint)  # nothing in it runs code in the ranks (it would be refused there)
    manifest = _checked(path, read_manifest)
    step = manifest.get("step") if isinstance(manifest, dict) else None
    saved = manifest.get("config") if isinstance(manifest, dict) else None
    if isinstance(saved, Mapping) and starts_adapters(_flat(saved), _flat(to_container(cfg)), path):
        return _start_from(cfg, saved, path, step, notices)
    notices.append(f"note: resuming from {path}" + (f" (step {step})" if step is not None else ""))
    if isinstance(saved, Mapping):
        notices.extend(compare(saved, to_container(cfg), path))
    base = _base_source(saved, path, notices)  # adapters trained on a full fine-tune: its base again
    resumed = _with_run_id(dataclasses.replace(cfg, resume=path, start_from=base), manifest)
    if cfg.run_id is None and not _saved_run_id(manifest):
        notices.append(
            f"note: {path} records no run id (saved before run ids): this run's saves get their own, "
            "and retention leaves the older saves in checkpoint.dir for you to remove"
        )
    return resumed, notices


ADAPTER_KEYS = ("peft.r", "peft.targets", "peft.trainable", "peft.bias")
"""Adapter settings whose change makes a LoRA checkpoint's tensors (or their optimizer state)
another set than the run's."""


def starts_adapters(before: Mapping[str, Any], after: Mapping[str, Any], path: str) -> bool:
    """Whether the run trains new adapters on a full fine-tune's checkpoint (``peft=lora
    resume=FULL``); :class:`ConfigError` where the fine-tuning mode or the adapters' settings
    changed so that the checkpoint cannot be continued."""
    was, now = str(before.get("peft.name", "none")), str(after.get("peft.name", "none"))
    if was == "none":
        return now != "none"
    saved = ", ".join(f"{k}={before.get(k)}" for k in ADAPTER_KEYS)
    if now == "none":
        raise ConfigError(
            "resume",
            path,
            f"the checkpoint holds peft={was} adapters ({saved}) and this run trains the whole model (peft=none)",
            hint=f"peft={was} with those settings continues it (for model=hf, fsdp-ckpt convert PATH OUT "
            "--to hf --merge gives merged weights to fine-tune in full)",
        )
    changed = [k for k in ADAPTER_KEYS if before.get(k) != after.get(k)]
    if changed:
        asked = ", ".join(f"{k}={after.get(k)}" for k in changed)
        raise ConfigError(
            "resume",
            path,
            f"the checkpoint's adapters were saved with {saved}; this run asks {asked}",
            hint="resume with the saved adapter settings, or train new adapters with resume=null",
        )
    return False


def _start_from(
    cfg: TrainConfig, saved: Mapping[str, Any], path: str, step: Any, notices: list[str]
) -> tuple[TrainConfig, list[str]]:
    """A new run on a full fine-tune's weights (same model checked): step 0, new adapters, new
    optimizer state, a run id of its own; ``start_from`` tells the ranks where the base is."""
    compare_model(_flat(saved), _flat(to_container(cfg)), path)
    at = f" (step {step})" if step is not None else ""
    notices.append(
        f"note: resume={path} is a full fine-tune{at}; peft={cfg.peft.name.value} trains new adapters on its "
        "weights: a new run from step 0 (new optimizer state and run id)"
    )
    fresh = dataclasses.replace(cfg, resume=None, start_from=path)
    return _with_run_id(fresh, None), notices


def _base_source(saved: Any, path: str, notices: list[str]) -> str | None:
    """Where the base of a run that trained adapters on a full fine-tune's weights came from
    (``start_from`` in its saved config): resumed, it reads the base from there again, since an
    adapters-only save holds none (rebuilt from the model's own weights, it would be another base)."""
    source = saved.get("start_from") if isinstance(saved, Mapping) else None
    if not source:
        return None
    if not Path(str(source)).exists():
        raise ConfigError(
            "resume",
            path,
            f"its run trained adapters on the weights of {source}, which is gone",
            hint="restore that checkpoint, or resume from one saved with peft.save_base=true",
        )
    notices.append(f"note: the frozen base is read from {source} again, as the run it resumes did")
    return str(source)


def _with_run_id(cfg: TrainConfig, manifest: Mapping[str, Any] | None) -> TrainConfig:
    """A resumed run continues the run it resumes (its saves are this run's to prune); a fresh
    one, or one resuming a checkpoint without an id, gets a new id. One set already is kept."""
    if cfg.run_id is not None:
        return cfg
    return dataclasses.replace(cfg, run_id=_saved_run_id(manifest) or new_run_id())


def _saved_run_id(manifest: Any) -> str | None:
    saved = manifest.get(RUN_ID_KEY) if isinstance(manifest, Mapping) else None
    return saved if isinstance(saved, str) and saved else None


def _checked(path: str, check: Any) -> Any:
    """``check(path)``; a checkpoint that fails it is a one-line config error."""
    try:
        return check(path)
    except UnsafeCheckpointError as err:
        raise ConfigError(
            "resume", path, str(err), hint="resume only from checkpoints you trust (docs/checkpoints.md)"
        ) from None
    except CheckpointFormatError as err:
        raise ConfigError(
            "resume",
            path,
            str(err).removeprefix(f"{path}: "),
            hint="fsdp-ckpt verify PATH checks a checkpoint; resume=auto picks the newest intact one",
        ) from None


def compare(saved: Mapping[str, Any], current: Mapping[str, Any], path: str) -> list[str]:
    """Notices for compatible changes; :class:`ConfigError` for an incompatible model."""
    before, after = _flat(saved), _flat(current)
    changed = compare_model(before, after, path)
    was, now = _accumulation(before), _accumulation(after)
    if was and now and was != now:
        raise ConfigError(
            "resume",
            path,
            f"gradient accumulation would change from {was} to {now} micro-batches per step",
            hint="keep global_batch_size / (dp * micro_batch_size) as it was, e.g. adjust data.micro_batch_size",
        )
    if not changed:
        return []
    listed = ", ".join(f"{k}: {before.get(k)} -> {after.get(k)}" for k in changed)
    return [f"note: changed since the checkpoint (compatible, proceeding): {listed}"]


def compare_model(before: Mapping[str, Any], after: Mapping[str, Any], path: str) -> list[str]:
    """The keys changed since the checkpoint (``IGNORED`` aside); :class:`ConfigError` when one
    of them changes the model's tensors."""
    changed = sorted(
        k for k in before.keys() | after.keys() if before.get(k) != after.get(k) and not k.startswith(IGNORED)
    )
    custom = "model._target_" in before
    shape = [k for k in changed if k in SHAPE_KEYS or (custom and k.startswith("model."))]
    if shape:
        detail = ", ".join(f"{k}: {before.get(k)} -> {after.get(k)}" for k in shape)
        raise ConfigError(
            "resume",
            path,
            f"the checkpoint holds a different model ({detail})",
            hint="resume with the model settings it was trained with, or start fresh with resume=null",
        )
    return changed


def _accumulation(flat: dict[str, Any]) -> int | None:
    micro, dp, batch = flat.get("data.micro_batch_size"), flat.get("dp"), flat.get("data.global_batch_size")
    if micro is None or not isinstance(dp, int) or not batch:
        return 1 if batch else None
    return batch // (dp * micro)


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, Mapping):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}
