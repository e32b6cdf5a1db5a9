"""What a rank really ran with, read from its live objects: a Lightning callback that tests add to
a real ``fsdp-train`` run through Lightning's own entry-point group for external callbacks
(``lightning.pytorch.callbacks_factory``), so fsdp_cli carries no test hook.

:func:`probe_env` makes a directory holding the entry point (a ``*.dist-info`` that
``importlib.metadata`` finds on ``PYTHONPATH``) and returns the environment for ``run_cli``; every
rank then writes ``<probe dir>/rank<R>.json``:

* ``params`` / ``grads`` / ``optimizer_state``: the dtypes of the local tensors (DTensor shards,
  FSDP1 flat parameters) after the first backward and the first optimizer step;
* ``compute``: the dtypes of the LM head's input, weight and output during a training forward
  (outside any compiled block: a hook inside one would change what dynamo compiles); ``loss``:
  the dtype of the loss backward starts from;
* ``backward_collectives``: for one step's backward, the collectives the process groups ran,
  read from torch's flight recorders (:func:`probe_env` sets ``TORCH_FR_BUFFER_SIZE``, so that
  they record whatever this torch's default, with room for a whole run): each collective's name
  (``gloo:all_reduce``, ``gloo:all_gather``; on GPUs ``nccl:_reduce_scatter_base``, ...) with the dtypes
  of its input tensors, the buffers actually reduced or gathered, whether Python or C++ (DDP's
  reducer) issued them;
* ``step_work``: what the whole of one optimizer step issued (batch ``RECORDED_BATCH``, from its
  ``on_train_batch_start`` to the next one's: forward, backward, optimizer, every callback, the
  next batch's loading): the collectives the process groups ran (name -> count, from the flight
  recorders), the host synchronisations (``aten._local_scalar_dense``: ``.item()``, ``float()``,
  ``bool()`` of a tensor; a stall of the host behind the GPU there), every aten op dispatched, and
  the Python function calls (``sys.setprofile``): the per-step work a framework adds over a
  hand-written loop, counted rather than timed;
* ``float8_linears``: how many of the live modules are torchao's Float8Linear;
* ``dynamo``: torch._dynamo's counters after the first step and at the end (frames compiled,
  graphs, graph breaks), to show a compiled model compiles once.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

PROBE_DIR_ENV = "FSDP_CLI_TEST_PROBE_DIR"
STEP_WORK_ENV = "FSDP_CLI_TEST_PROBE_STEP_WORK"
RECORDED_BATCH = 2
"""The batch whose backward's collectives are recorded: after the first steps' lazy
initialisation and compile."""
FLIGHT_RECORDER_ENTRIES = 4096
"""Collectives the flight recorder keeps (a ring): more than any probed run issues."""

_FR_DTYPES = {
    "Float": "float32",
    "Double": "float64",
    "BFloat16": "bfloat16",
    "Half": "float16",
    "Byte": "uint8",
}
"""The flight recorder's dtype names (c10's ScalarType names) as torch's."""


def probe_env(root: Path, *, step_work: bool = False) -> dict[str, str]:
    """The environment that makes every rank of a run load :class:`LiveProbe`, writing under
    ``root/probe``; the entry point lives in ``root/entry_point``. ``step_work``: count one step's
    work too (its dispatch mode and profile hook change what dynamo guards on: a compiled run
    would recompile, so runs that test compilation leave it off)."""
    dist_info = root / "entry_point" / "fsdp_cli_test_probe-0.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: fsdp-cli-test-probe\nVersion: 0\n")
    (dist_info / "entry_points.txt").write_text(
        "[lightning.pytorch.callbacks_factory]\nlive_probe = tests.assets.live_probe:callbacks\n"
    )
    repo = Path(__file__).resolve().parents[2]
    paths = [str(dist_info.parent), str(repo), os.environ.get("PYTHONPATH", "")]
    return {
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        PROBE_DIR_ENV: str(root / "probe"),
        STEP_WORK_ENV: "1" if step_work else "",
        "TORCH_FR_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES),
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES),  # its name in older torch
    }


def read_probe(root: Path, rank: int = 0) -> dict[str, Any]:
    return json.loads((root / "probe" / f"rank{rank}.json").read_text())


def callbacks() -> list[L.Callback]:
    """The entry point: a probe when the test asked for one, nothing otherwise."""
    where = os.environ.get(PROBE_DIR_ENV)
    return [LiveProbe(Path(where))] if where else []


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def dtypes_of(tensors: Any) -> list[str]:
    return sorted({dtype_name(local(t).dtype) for t in tensors if t is not None})


def head_linear(module: nn.Module) -> nn.Module:
    """The last linear layer (the LM head of the built-in model), wherever wrappers put it."""
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    assert linears, "no nn.Linear in the model"
    return linears[-1]


RECORDERS = ("_dump_fr_trace_json", "_dump_nccl_trace_json")
"""torch's flight recorders (private API: fine in a test asset; it is what torch's own
flight-recorder tooling reads): the one for CPU process groups (gloo), and NCCL's, which only CUDA
builds have. Each dump's record ids are compared with its own (a torch whose two dumps show the
same recorder lists each collective twice, which the dtype sets absorb)."""


def flight_recorder() -> list[dict[str, Any]]:
    """The collectives this process's groups recorded, each with the recorder that holds it."""
    import torch._C._distributed_c10d as c10d

    entries = []
    for recorder in RECORDERS:
        dump = getattr(c10d, recorder, None)
        if dump is not None:
            found = json.loads(dump(True, False)).get("entries", [])
            entries += [{**e, "recorder": recorder} for e in found]
    return entries


def last_record_ids() -> dict[str, int]:
    """Per recorder, the id of the newest entry."""
    newest: dict[str, int] = {}
    for e in flight_recorder():
        newest[e["recorder"]] = max(newest.get(e["recorder"], -1), e["record_id"])
    return newest


def collectives_since(newest: dict[str, int]) -> dict[str, list[str]]:
    """Each collective recorded after ``newest`` (:func:`last_record_ids`) -> its input dtypes."""
    found: dict[str, set[str]] = {}
    for e in flight_recorder():
        if e["record_id"] > newest.get(e["recorder"], -1):
            found.setdefault(e["profiling_name"], set()).update(
                _FR_DTYPES.get(d, d) for d in e["input_dtypes"]
            )
    return {name: sorted(dtypes) for name, dtypes in sorted(found.items())}


def dynamo_counters() -> dict[str, Any]:
    from torch._dynamo.utils import counters  # private: fine in a test asset (see the issue brief)

    return {
        "frames_total": counters["frames"]["total"],
        "frames_ok": counters["frames"]["ok"],
        "unique_graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "graph_break_reasons": sorted(counters["graph_break"]),
    }


class StepWork(TorchDispatchMode):
    """Counts what one stretch of a rank's main thread issues (see ``step_work`` above)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.host_syncs = self.python_calls = 0
        self._before: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        self.host_syncs += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))

    def _count_call(self, frame: Any, event: str, arg: Any) -> None:
        self.python_calls += event == "call"

    def start(self) -> None:
        self._before = last_record_ids()
        self.__enter__()
        sys.setprofile(self._count_call)

    def stop(self) -> dict[str, Any]:
        sys.setprofile(None)
        self.__exit__(None, None, None)
        collectives: dict[str, int] = {}
        for e in flight_recorder():
            if e["record_id"] > self._before.get(e["recorder"], -1):
                collectives[e["profiling_name"]] = collectives.get(e["profiling_name"], 0) + 1
        return {
            "collectives": dict(sorted(collectives.items())),
            "host_syncs": self.host_syncs,
            "ops": self.ops,
            "python_calls": self.python_calls,
        }


class LiveProbe(L.Callback):
    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.info: dict[str, Any] = {}
        self._batch = -1
        self._before_backward: dict[str, int] | None = None
        self._hook: Any = None
        self._step_work: StepWork | None = None

    # -- compute dtype: the head's forward, once
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._hook = head_linear(pl_module).register_forward_hook(self._record_head)
        self.info["float8_linears"] = sum(type(m).__name__ == "Float8Linear" for m in pl_module.modules())

    def _record_head(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        self.info["compute"] = {
            "input": dtype_name(args[0].dtype),
            "weight": dtype_name(module.weight.dtype),
            "output": dtype_name(output.dtype),
            "autocast": torch.is_autocast_enabled(args[0].device.type),
        }
        self._hook.remove()

    # -- gradients and the backward's collectives
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int
    ) -> None:
        self._batch = idx
        if idx == RECORDED_BATCH + 1 and self._step_work is not None:
            self.info["step_work"] = self._step_work.stop()
            self._step_work = None
        if idx == RECORDED_BATCH and "step_work" not in self.info and os.environ.get(STEP_WORK_ENV):
            self._step_work = StepWork()
            self._step_work.start()

    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        self.info.setdefault("loss", dtype_name(loss.dtype))
        if self._batch == RECORDED_BATCH and "backward_collectives" not in self.info:
            self._before_backward = last_record_ids()

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._before_backward is not None:
            self.info["backward_collectives"] = collectives_since(self._before_backward)
            self._before_backward = None

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        if "grads" not in self.info:
            self.info["params"] = dtypes_of(pl_module.parameters())
            self.info["grads"] = dtypes_of(p.grad for p in pl_module.parameters())

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if "dynamo" not in self.info:  # this process's first batch (a resumed run's too)
            self.info["optimizer_state"] = dtypes_of(
                v
                for opt in trainer.optimizers
                for s in opt.state.values()
                for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0
            )
            self.info["dynamo"] = {"after_first_step": dynamo_counters()}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.info.setdefault("dynamo", {})["at_end"] = dynamo_counters()
        self.info["steps"] = trainer.global_step
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.info, indent=1))
        print(f"live_probe: wrote rank{trainer.global_rank}.json", file=sys.stderr)
