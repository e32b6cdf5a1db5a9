"""``peft=lora`` on top of a full fine-tune: the run starts at step 0 with new adapters, its
frozen base read from the full fine-tune's checkpoint (decided in the parent by
:func:`fsdp_cli.checkpoint.resume.resolve_resume`, which sets ``start_from``).

Every rank reads its own part, whatever the layout: from a sharded checkpoint straight into its
shards (DCP reshards), from a full one each tensor set through torch's state-dict API. The names
are the model's without wrappers (:func:`fsdp_cli.parallel.names.canonical_name`): a layer LoRA
wraps reads the weight the checkpoint saved under the layer's own name; the adapters keep their
fresh start (``lora_B`` zero: the model starts as the full fine-tune left it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L

from fsdp_cli.parallel.names import canonical_name

ADAPTER_MARKS = (".lora_", "_lora_A", "_lora_B")
"""What an adapter's name holds: peft's ``q_proj.lora_A.default.weight``, or a pair on a fused
experts tensor, ``experts.gate_up_proj_lora_A`` (:mod:`fsdp_cli.adapters.experts`)."""


def is_adapter(name: str) -> bool:
    return ADAPTER_MARKS[0] in name or name.endswith(ADAPTER_MARKS[1:])


class StartFromWeights(L.Callback):
    """Fills the model's non-adapter tensors from ``path`` once the strategy has built and sharded
    it, before the first step."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        load_base_weights(trainer.strategy.model, self.path)


def load_base_weights(model: Any, path: Path) -> None:
    """Every tensor of ``model``'s state dict but its adapters, read from the checkpoint at
    ``path`` under its canonical name; a name the checkpoint lacks is an error naming it."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from fsdp_cli.checkpoint.format import CheckpointFormat, checkpoint_format

    state = get_model_state_dict(model)
    wanted = {canonical_name(k): k for k in state if not is_adapter(k)}
    if checkpoint_format(path) is CheckpointFormat.sharded:
        from fsdp_cli.checkpoint.convert import sharded_metadata
        from fsdp_cli.checkpoint.untrusted import dcp_load

        saved = {k.partition(".")[2] for k in sharded_metadata(path).state_dict_metadata}
        _check_holds(saved, wanted, path)
        dcp_load({"state_dict": {name: state[key] for name, key in wanted.items()}}, path)
        set_model_state_dict(model, state, options=StateDictOptions(strict=False))
        return
    from fsdp_cli.checkpoint.format import load_full

    full = load_full(path)["state_dict"]
    _check_holds(set(full), wanted, path)
    given = {key: full[name] for name, key in wanted.items()}
    set_model_state_dict(model, given, options=StateDictOptions(full_state_dict=True, strict=False))


def _check_holds(saved: set[str], wanted: dict[str, str], path: Path) -> None:
    missing = sorted(set(wanted) - saved)
    if missing:
        raise RuntimeError(
            f"{path}: the checkpoint lacks {', '.join(missing[:6])} (a full fine-tune saves every weight)"
        )
