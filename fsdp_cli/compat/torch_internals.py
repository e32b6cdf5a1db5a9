"""torch internals: mesh flattening, DTensor shard offsets, the activation-checkpoint wrapper,
FSDP1's zero-2 hybrid strategy, the ParallelStyle extension point and the layouts a column- or
row-parallel style holds, dispatch modes (to see every
random fill of a tensor), a module's set of non-persistent buffers, whether a module was
compiled in place, a function applied to every parameter and buffer of a module (``_apply``,
the path ``Module.to`` takes), DDP's keyword for per-forward buffer syncing (renamed in torch 2.13), the
tensor an asynchronous functional collective returns before it is waited on, the plain
tensors inside a wrapper tensor subclass (torchao's float8 weights), the mixed-precision
policy ``fully_shard`` recorded on a module, the private classes a DCP ``.metadata`` pickle
names (for the restricted unpickler of :mod:`fsdp_cli.checkpoint.untrusted`), and what a rehearsal
(:mod:`fsdp_cli.plan.rehearsal`) needs: fake tensors, torch's memory trackers, and a pipeline
schedule's warm-up vote settled without peers; a tensor's in-place version counter (the pipeline
cut check: work done in place between a model's parts); the local tensor object a DTensor holds
(QLoRA's NF4 shards are written into the object FSDP2's all-gather reads)."""

from __future__ import annotations

import inspect
from typing import Any

import torch as _torch
from torch import serialization as _serialization
from torch._subclasses import fake_tensor as _fake_tensor
from torch.distributed import Backend
from torch.distributed import _functional_collectives as _funcol
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as _ac_wrapper
from torch.distributed.checkpoint import filesystem as _dcp_filesystem
from torch.distributed.checkpoint import metadata as _dcp_metadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import ShardingStrategy as _FSDP1ShardingStrategy
from torch.distributed.tensor import _utils as _dtensor_utils
from torch.distributed.tensor.experimental._context_parallel import _attention as _cp_attention
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.utils import _python_dispatch

from fsdp_cli.compat import require

ENTRIES: list[tuple[Any, str]] = [
    (DeviceMesh, "_flatten"),
    (_dtensor_utils, "compute_local_shape_and_global_offset"),
    (_ac_wrapper, "checkpoint_wrapper"),
    (_ac_wrapper, "CheckpointWrapper"),
    (_FSDP1ShardingStrategy, "_HYBRID_SHARD_ZERO2"),
    (ParallelStyle, "_apply"),
    # The layouts a column- or row-parallel style was given (LoRA's adapters follow their layer's:
    # fsdp_cli.adapters.tensor_parallel): public attributes, undocumented.
    *(
        (style(), name)
        for style in (ColwiseParallel, RowwiseParallel)
        for name in ("input_layouts", "output_layouts", "use_local_output")
    ),
    (_python_dispatch, "TorchDispatchMode"),
    (Module(), "_non_persistent_buffers_set"),
    (Module(), "_compiled_call_impl"),
    (Module, "_apply"),
    (_fake_tensor, "FakeTensorMode"),
    (_fake_tensor, "DataDependentOutputException"),
    (_fake_tensor, "DynamicOutputShapeException"),
    (_fake_tensor, "UnsupportedOperatorException"),
    # Public, but only recent torch has it: init_process_group("fake") without a store.
    (Backend, "FAKE"),
    (_funcol, "AsyncCollectiveTensor"),
    (_funcol, "wait_tensor"),
    (_funcol, "all_to_all_single_autograd"),
    (_torch._C, "_clear_DTensor_sharding_propagator_cache"),
    (DeviceMesh, "_get_slice_mesh_layout"),
    (_python_dispatch, "is_traceable_wrapper_subclass"),
    (FSDPModule, "_get_fsdp_state"),
    (_dcp_filesystem, "_StorageInfo"),
    (_dcp_metadata, "_MEM_FORMAT_ENCODING"),
    (_serialization, "_get_layout"),
    (_torch.empty(0), "_version"),
    # torch's ring attention (cp_impl=ring, GPUs): SDPA on DTensors sharded along the sequence is
    # dispatched to it once its handlers are on; load-balanced (head-tail) slices.
    (_cp_attention, "_enable_cp_dtensor_dispatcher"),
    (_cp_attention, "_cp_options"),
    (_cp_attention, "_DispatchMode"),
]
for _owner, _name in ENTRIES:
    require(_owner, _name, "torch")

checkpoint_wrapper = _ac_wrapper.checkpoint_wrapper
DCP_METADATA_INTERNALS: dict[tuple[str, str], Any] = {
    (owner.__name__, name): getattr(owner, name)
    for owner, name in (
        (_dcp_filesystem, "_StorageInfo"),  # where each entry lies: file, offset, length
        (_dcp_metadata, "_MEM_FORMAT_ENCODING"),  # TensorProperties' memory format, as an enum
        (_serialization, "_get_layout"),  # torch.strided etc. by name (a lookup in torch's table)
    )
}
"""The private names a DCP ``.metadata`` pickle refers to, as (module, name) -> object: only the
restricted unpickler resolves them (:mod:`fsdp_cli.checkpoint.untrusted`)."""
CheckpointWrapper = _ac_wrapper.CheckpointWrapper

# fsdp_cli's public names for FSDP1 sharding strategies torch keeps private.
FSDP1_SHARDING = {"HYBRID_SHARD_ZERO2": "_HYBRID_SHARD_ZERO2"}


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """``mesh`` (a slice of a root mesh) as one flattened dimension called ``name``."""
    return mesh._flatten(name)


def clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions (the C++ fast path's and the Python one's). They
    are keyed by meshes compared by value, and hold the mesh they were made with: after a fake
    process group is torn down, a later one's mesh equal by value (the same tp ranks of another
    layout) would be handed the dead world's groups (a rehearsal after another in one process)."""
    from torch.distributed.tensor import DTensor

    _torch._C._clear_DTensor_sharding_propagator_cache()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()


def slice_beside_flattened(root: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """``root[names]`` where some of ``names`` were flattened from it (HSDP's replicate beside
    shard x cp): torch warns that this will go, and keeps no other way to name such a 2-D mesh
    (checked by :data:`ENTRIES`' slicing helper)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
        return root[names]


def all_to_all(tensor: _torch.Tensor, group: Any) -> _torch.Tensor:
    """Equal slices of dim 0 of ``tensor`` exchanged over ``group``, the gradient exchanged back
    in backward (the functional collective: ``torch.distributed.nn``'s is deprecated)."""
    return wait_if_async_collective(_funcol.all_to_all_single_autograd(tensor, None, None, group))


def ring_attention(q: _torch.Tensor, k: _torch.Tensor, v: _torch.Tensor, mesh: DeviceMesh, scale: Any) -> Any:
    """Causal attention of this rank's load-balanced slices ``[B, H, T / cp, d]`` of q, k and v
    over the whole sequence of the ``cp`` ranks of ``mesh``, by torch's ring attention (GPU
    kernels only: the CPU SDPA op has no sharding rule); the output slice, with its backward."""
    from torch.distributed.tensor import DTensor, Shard

    if not getattr(ring_attention, "enabled", False):
        _cp_attention._dispatch_mode = _cp_attention._DispatchMode.MODULE_WRAPPER  # F left unpatched
        _cp_attention._cp_options.enable_load_balance = True  # the slices are head-tail
        _cp_attention._enable_cp_dtensor_dispatcher()
        ring_attention.enabled = True  # type: ignore[attr-defined]
    q, k, v = (DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in (q, k, v))
    out = _torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out.to_local()


def all_to_all_uneven(
    tensor: _torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any
) -> _torch.Tensor:
    """Rows of ``tensor`` exchanged over ``group``, ``input_splits[i]`` of them to rank i and
    ``output_splits[i]`` from it (unequal and empty splits), the gradient exchanged back."""
    return wait_if_async_collective(
        _funcol.all_to_all_single_autograd(tensor, output_splits, input_splits, group)
    )


TorchDispatchMode = _python_dispatch.TorchDispatchMode
"""Subclass and enter to see every aten call (the public API for this, kept under a private module)."""


def non_persistent_buffer_names(module: Module) -> set[str]:
    """Buffers of ``module`` itself that ``state_dict`` leaves out (recomputed, never saved)."""
    return set(module._non_persistent_buffers_set)


def local_box(tensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, offset) of a DTensor's local shard within the whole tensor, from shapes alone."""
    shape, offset = _dtensor_utils.compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    return tuple(shape), tuple(offset)


def dtensor_local_object(tensor: Any) -> Any:
    """The local tensor object ``tensor`` (a DTensor) holds itself: ``to_local()`` may hand back
    another object (an autograd view), and state set on that would not reach FSDP2's all-gather,
    which reads this one. A plain tensor is its own."""
    return getattr(tensor, "_local_tensor", tensor)


def global_offset(tensor: Any) -> tuple[int, ...]:
    """Offset of a DTensor's local shard within the whole tensor, from shapes alone."""
    _, offset = _dtensor_utils.compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    return tuple(offset)


def apply_to_tensors(module: Module, fn: Any) -> Module:
    """``module`` with ``fn(tensor)`` put in place of each parameter and buffer, as ``module.to``
    does (``Module._apply``: FSDP2 reshards around it), but with a function that can tell the
    tensors apart (``.to`` casts them all)."""
    return module._apply(fn)


def fsdp1_sharding_strategy(name: str) -> Any:
    """torch's FSDP1 ``ShardingStrategy`` member for one of our names."""
    return _FSDP1ShardingStrategy[FSDP1_SHARDING.get(name, name)]


def is_compiled_in_place(module: Module) -> bool:
    """Whether ``module.compile()`` replaced its forward (torch keeps it in ``_compiled_call_impl``)."""
    return module._compiled_call_impl is not None


def fsdp2_mp_policies(module: FSDPModule) -> list[Any]:
    """The MixedPrecisionPolicy ``fully_shard`` recorded for this unit's parameters (one per
    parameter group; none for a unit without parameters of its own). torch >= 2.10 keeps a list
    of groups (``_fsdp_param_groups``), older releases one (``_fsdp_param_group``)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = require(state, "_fsdp_param_group", "torch")
        groups = [group] if group is not None else []
    return [require(group, "mp_policy", "torch") for group in groups]


def ddp_buffer_sync(sync_every_forward: bool) -> dict[str, bool]:
    """DistributedDataParallel's keyword for broadcasting buffers before each forward:
    ``forward_sync_buffers`` where torch has it (``broadcast_buffers`` is deprecated there),
    ``broadcast_buffers`` before. Either way buffers are still synced once at construction."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": sync_every_forward}
    return {"broadcast_buffers": sync_every_forward}


FakeTensorMode = _fake_tensor.FakeTensorMode
"""Tensors with shapes, dtypes and devices but no memory: a rehearsal's "allocations" (the public
``torch._subclasses`` name lives in a private module)."""

NOT_FAKEABLE: tuple[type[Exception], ...] = (
    _fake_tensor.DataDependentOutputException,
    _fake_tensor.DynamicOutputShapeException,
    _fake_tensor.UnsupportedOperatorException,
)
"""What fake tensors raise for an op whose result depends on values (``.item()``, ``nonzero``) or
that has no fake implementation: a model doing that cannot be stepped without real data."""


def memory_trackers() -> tuple[Any, Any]:
    """torch's ``(FSDPMemTracker, MemTracker)``: every tensor alive during a step, by kind, and the
    peak. Imported on first use, not with this module: they cost about a second to import, which
    every rank would pay. Checked like the entries above when they are imported."""
    from torch.distributed._tools import fsdp2_mem_tracker, mem_tracker

    return (
        require(fsdp2_mem_tracker, "FSDPMemTracker", "torch"),
        require(mem_tracker, "MemTracker", "torch"),
    )


def wait_if_async_collective(tensor: Any) -> Any:
    """``tensor`` as a plain tensor if it is the in-flight result of an asynchronous collective
    (an ``AsyncCollectiveTensor``, what tensor-parallel styles return), waiting for it; anything
    else unchanged. The wait is an autograd op: gradients flow through it (``AsyncCollectiveTensor.wait()``
    returns the bare result, cut off from the graph)."""
    return _funcol.wait_tensor(tensor) if isinstance(tensor, _funcol.AsyncCollectiveTensor) else tensor


def plain_tensors(tensor: Any) -> list[Any]:
    """The tensors holding ``tensor``'s memory: itself, or for a wrapper tensor subclass (torchao's
    float8 weights; it has no storage of its own) the tensors it wraps, recursively."""
    if not _python_dispatch.is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [inner for name in names for inner in plain_tensors(getattr(tensor, name))]


def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None skipped; DTensors by their local
    shard, wrapper subclasses such as torchao's float8 weights by the tensors they wrap): what
    they hold in memory, views of one buffer counted once, padding included. Storages are told
    apart by torch's storage handle, which fake and meta tensors have too (their data pointers
    are all 0): the live setup report and the rehearsal count alike."""
    from torch.multiprocessing.reductions import StorageWeakRef

    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        for inner in plain_tensors(t.to_local() if hasattr(t, "to_local") else t):
            storage = inner.untyped_storage()
            seen[StorageWeakRef(storage).cdata] = storage.nbytes()
    return sum(seen.values())


def inplace_version(tensor: Any) -> int:
    """How many in-place operations ``tensor`` has seen (autograd's version counter)."""
    return int(tensor._version)  # (checked at import: ENTRIES)


def settle_pipeline_warmup(schedule: Any) -> None:
    """Give ``schedule`` the outcome of its warm-up vote without holding it.

    torch 2.13's schedules start with a vote over the pipeline's ranks (each stage sends whether
    it was given its input and output shapes; the product comes back and is read with
    ``.item()``): static metadata where every stage was given them, else an exchange of shapes.
    On a fake process group nothing a peer "sent" arrives, so a rehearsal whose stages were all
    given their shapes (as every rank's are, by the same code) sets the static outcome itself.
    Older torch has no vote: nothing to do."""
    if not hasattr(schedule, "_warmup_p2p"):
        return
    from torch.distributed.pipelining import _utils as _pp_utils

    inference_mode = require(_pp_utils, "InferenceMode", "torch")

    def warmup(stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            if inference_mode.needs_dynamic(stage._user_meta, has_backward):
                raise RuntimeError(f"pipeline stage {stage.stage_index} was not given its shapes")
            stage._inference_mode = inference_mode.STATIC

    schedule._warmup_p2p = warmup


def pipeline_stages(schedule: Any) -> list[Any]:
    """The ``PipelineStage`` objects a schedule drives (torch keeps them private: one for the
    single-stage schedules, a list for the others)."""
    many = getattr(schedule, "_stages", None)
    return list(many) if many is not None else [require(schedule, "_stage", "torch")]
