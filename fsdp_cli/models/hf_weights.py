"""Filling a Hugging Face model's tensors in place, after sharding: streamed from safetensors, or fresh.

Whatever each parameter is by then — a plain tensor (DDP, one FSDP1 unit before it is sharded),
an FSDP2 shard, a tensor-parallel shard, or both — :class:`WeightFiller` writes just this rank's
part of it:

* **pretrained**: each checkpoint tensor is read from its safetensors file, and only the slice
  this rank owns when that slice is one box of the full tensor (``safe_open(...).get_slice``);
  otherwise (FSDP over a tensor-parallel dimension) the full tensor is read, sliced, and dropped.
  One file is open at a time and no rank ever holds more than one whole tensor.
* **fresh** (``model.pretrained=false``) and whatever a checkpoint lacks (recomputed buffers such
  as RoPE's ``inv_freq``): the model's own ``_init_weights``, module by module, each module seeded
  from (seed, its name), with every random fill of a sharded tensor drawn whole and sliced
  (:class:`LayoutIndependentRandom`). The same seed gives the same weights on every layout, one
  process included, and whatever order the modules are filled in (FSDP1 fills unit by unit).
"""

from __future__ import annotations

import contextlib
import re
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_cli.compat.torch_internals import TorchDispatchMode, local_box, non_persistent_buffer_names
from fsdp_cli.models.folder import weight_files
from fsdp_cli.parallel.names import canonical_name

# Keys every model ignores when loading: buffers older checkpoints saved that modules now recompute.
ALWAYS_IGNORED = (r"rotary_emb\.inv_freq", r"(^|\.)position_ids$")


@dataclass(frozen=True)
class HFSource:
    path: Path
    pretrained: bool
    seed: int
    copies: dict[str, str] = field(default_factory=dict)
    """Tensor name -> the name whose saved weight it starts from (a head untied on purpose:
    ``lm_head.weight`` from ``model.embed_tokens.weight``)."""


@dataclass
class LoadReport:
    """What filling did on this rank (shown in ``summary.json`` under ``setup.weights``)."""

    pretrained: bool
    files: int = 0
    tensors_read: int = 0
    bytes_read: int = 0
    """Bytes read from the checkpoint: only this rank's slices where the layout allows."""
    max_full_tensor_bytes: int = 0
    """The largest tensor this rank ever held whole (a replicated norm; never the model)."""
    local_param_bytes: int = 0
    seconds: float = 0.0


class WeightFiller:
    """Everything about the model that filling needs, read while it is still on the meta device."""

    def __init__(self, hf: nn.Module, source: HFSource) -> None:
        from fsdp_cli.compat.transformers_internals import ignored_checkpoint_keys

        self.hf = hf
        self.source = source
        self.report = LoadReport(pretrained=source.pretrained)
        self.names = {id(m): canonical_name(n) for n, m in hf.named_modules(remove_duplicate=False)}
        # By name too: FSDP1 later inserts wrappers into the module paths, not into these.
        self.modules = {canonical_name(n): m for n, m in hf.named_modules(remove_duplicate=False)}
        self.owners = _owners(hf)
        # Asked of the class now: after fully_shard it is FSDP<Class>, which transformers takes for remote code.
        self.custom_code = bool(type(hf).is_custom_code())
        mapping = getattr(hf, "all_tied_weights_keys", None) or {}
        self.tied: dict[str, str] = dict(mapping)
        self.expected = set(_tensors(hf))
        unexpected, missing = ignored_checkpoint_keys(hf)
        self.ignore_unexpected = [re.compile(p) for p in (*unexpected, *ALWAYS_IGNORED)]
        self.ignore_missing = [re.compile(p) for p in missing]
        self._locations: dict[str, tuple[Path, str]] | None = None
        self._experts: dict[str, dict[tuple[int, int], tuple[Path, str]]] = {}
        """Fused experts tensors the checkpoint holds one tensor per expert for (the hub's layout):
        name -> (expert, part) -> (file, key)."""

    # ------------------------------------------------------------------ the entry point

    def fill(self, modules: Sequence[nn.Module] | None = None) -> None:
        """Fill the tensors that ``modules`` (default: every module) hold themselves."""
        started = time.perf_counter()
        self._learn_swapped_modules()
        selected = list(self.hf.modules()) if modules is None else list(modules)
        ids = {id(m) for m in selected}
        self._retie(ids)
        targets = {
            name: t
            for m in selected
            if id(m) in self.names
            for name, t in _own_tensors(m, self.names[id(m)]).items()
        }
        for module in selected:
            _poison_recomputed_buffers(module)
            _clear_marks(module)
        if self.source.pretrained:
            self._load(targets)
        self._initialize(ids)
        _check_recomputed_buffers(selected, self.names)
        self.report.local_param_bytes = sum(_local_bytes(p) for p in self.hf.parameters())
        self.report.seconds += time.perf_counter() - started

    def _learn_swapped_modules(self) -> None:
        """Modules put in place of the model's own since it was built (float8's ``Float8Linear``
        for an ``nn.Linear``) are known by their place: filled and initialised like the ones they
        replaced (known only by object, they were skipped: left as ``to_empty`` made them).
        Modules added beside the model's own (LoRA's adapters around a layer still in the model)
        stay unknown: their own code initialises them."""
        present = {id(m) for m in self.hf.modules()}
        for name, module in self.hf.named_modules(remove_duplicate=False):
            place = canonical_name(name)
            replaced = self.modules.get(place)
            if id(module) not in self.names and replaced is not None and id(replaced) not in present:
                self.names[id(module)] = place
                self.modules[place] = module
        self.owners.update({k: v for k, v in _owners(self.hf).items() if k not in self.owners})

    # ------------------------------------------------------------------ ties

    def _retie(self, ids: set[int]) -> None:
        """``to_empty`` of plain modules gives each tied name its own tensor again; tie them back
        (for the pairs whose holder is being filled)."""
        present = {id(m) for m in self.hf.modules()}
        for target, source in self.tied.items():
            (dst_owner, dst_name), (src_owner, src_name) = (self._holder(target), self._holder(source))
            if id(dst_owner) not in ids or id(src_owner) not in present:
                # (a source cut away: the last pipeline stage's head, read from the embedding's key)
                continue
            src, dst = getattr(src_owner, src_name), getattr(dst_owner, dst_name)
            if src is dst:
                continue
            if _fsdp2_managed(self.hf):
                # Swapping a parameter behind FSDP2's back would leave it gathering the old one.
                raise RuntimeError(f"{target} lost its tie to {source} under FSDP2")
            setattr(dst_owner, dst_name, src)

    def _holder(self, tensor_name: str) -> tuple[nn.Module, str]:
        owner, _, name = tensor_name.rpartition(".")
        return self.modules[owner], name

    # ------------------------------------------------------------------ pretrained weights

    def _load(self, targets: dict[str, torch.Tensor]) -> None:
        from safetensors import safe_open

        from fsdp_cli.compat.transformers_internals import mark_initialized

        locations = self._checkpoint_locations()
        by_file: dict[Path, list[tuple[str, str]]] = {}
        missing = []
        for name in targets:
            if name in self._experts:
                continue
            if name in locations:
                file, key = locations[name]
                by_file.setdefault(file, []).append((name, key))
            elif name not in self.tied and not any(r.search(name) for r in self.ignore_missing):
                missing.append(name)
        if missing:
            raise RuntimeError(f"{self.source.path}: the checkpoint lacks {', '.join(sorted(missing)[:8])}")
        filled: set[int] = set()
        self._load_experts(targets, set(by_file))
        for file, pairs in by_file.items():
            # safetensors memory-maps the file; get_slice reads only the bytes asked for.
            with safe_open(str(file), framework="pt", device="cpu") as reader:
                for name, key in pairs:
                    target = targets[name]
                    if id(target) not in filled:  # the second name of a tied pair
                        _copy_into(target, reader, key, self.report)
                        filled.add(id(target))
                    mark_initialized(target)
            self.report.files += 1

    def _load_experts(self, targets: dict[str, torch.Tensor], other_files: set[Path]) -> None:
        """The fused experts tensors among ``targets`` the checkpoint holds one tensor per expert for."""
        from fsdp_cli.compat.transformers_internals import mark_initialized

        for name, parts in self._experts.items():
            if name in targets:
                _copy_experts(targets[name], parts, self.report)
                mark_initialized(targets[name])
        expert_files = {file for name in targets for file, _ in self._experts.get(name, {}).values()}
        self.report.files += len(expert_files - other_files)

    def _checkpoint_locations(self) -> dict[str, tuple[Path, str]]:
        """Model tensor name -> (file, checkpoint key), from the index or the files' headers (once)."""
        if self._locations is not None:
            return self._locations
        from safetensors import safe_open

        from fsdp_cli.compat.transformers_internals import checkpoint_key_renamer

        to_name = KeyMapper(
            checkpoint_key_renamer(self.hf), self.expected, getattr(self.hf, "base_model_prefix", "")
        )
        locations: dict[str, tuple[Path, str]] = {}
        unexpected = []
        for file in weight_files(self.source.path):
            with safe_open(str(file), framework="pt", device="cpu") as reader:
                keys = list(reader.keys())
            for key in keys:
                name, part = to_name.expert_part(key)
                if part is not None and name in self.expected:
                    expert, index, _ = part
                    self._experts.setdefault(name, {})[(expert, index)] = (file, key)
                    continue
                name = to_name(key)
                if name in self.expected:
                    locations[name] = (file, key)
                elif not any(r.search(key) for r in self.ignore_unexpected):
                    unexpected.append(key)
        if unexpected:
            raise RuntimeError(
                f"{self.source.path}: checkpoint keys {', '.join(unexpected[:8])} match no {type(self.hf).__name__} tensor"
            )
        # A head untied on purpose, or tied to an embedding this rank does not hold (the last
        # pipeline stage's copy): read from the embedding's key.
        for name, source in {**self.tied, **self.source.copies}.items():
            if name not in locations and source in locations:
                locations[name] = locations[source]
        self._locations = locations
        return locations

    # ------------------------------------------------------------------ init

    def _initialize(self, ids: set[int]) -> None:
        """transformers' init of each selected module (post-order, as ``initialize_weights``), each
        seeded from (seed, module name); tensors already loaded carry transformers' mark and stay."""
        from fsdp_cli.compat.transformers_internals import guard_torch_init_functions, initialize_module

        devices = sorted({p.device.index or 0 for p in self.hf.parameters() if p.device.type == "cuda"})
        with (
            torch.random.fork_rng(devices=devices),
            LayoutIndependentRandom(self.report),
            guard_torch_init_functions(),
        ):
            for module in _post_order(self.hf):
                if id(module) in ids and id(module) in self.owners:
                    torch.manual_seed(module_seed(self.source.seed, self.names.get(id(module), "")))
                    fresh = _fresh_padding_row(module)
                    with _nf4_drawn_whole(module):
                        initialize_module(self.owners[id(module)], module, custom_code=self.custom_code)
                    if fresh:
                        _zero_padding_row(module)


@contextlib.contextmanager
def _nf4_drawn_whole(module: nn.Module) -> Iterator[None]:
    """A fresh init of a QLoRA base layer: its NF4 weight (not loaded, so not marked) is drawn as a
    plain full tensor by the model's own init, then quantized whole and this rank's rows kept."""
    from fsdp_cli.compat.transformers_internals import INIT_FLAG
    from fsdp_cli.parallel.nf4 import is_quantized, write_full

    swapped = {
        name: param
        for name, param in module.named_parameters(recurse=False)
        if is_quantized(param) and not getattr(param, INIT_FLAG, False)
    }
    for name, param in swapped.items():
        setattr(
            module,
            name,
            nn.Parameter(torch.empty(tuple(param.shape), dtype=param.dtype), requires_grad=False),
        )
    drawn = {}
    try:
        yield
        drawn = {name: getattr(module, name).detach() for name in swapped}
    finally:
        for name, param in swapped.items():
            setattr(module, name, param)
    for name, full in drawn.items():  # (not after an init that failed: the error is what counts)
        write_full(swapped[name], full)


def _fresh_padding_row(module: nn.Module) -> bool:
    """An embedding with a padding row whose sharded weight the model's init is about to draw:
    its init zeroes ``weight[padding_idx]``, which on a DTensor writes to a copy."""
    from fsdp_cli.compat.transformers_internals import INIT_FLAG

    weight = getattr(module, "weight", None)
    return (
        isinstance(module, nn.Embedding)
        and module.padding_idx is not None
        and _is_dtensor(weight)
        and not getattr(weight, INIT_FLAG, False)
    )


def _zero_padding_row(module: nn.Embedding) -> None:
    """The padding row zeroed in this rank's part of the sharded weight, as one process's init does."""
    weight = module.weight
    keep = torch.ones(weight.shape[0], 1, dtype=weight.dtype, device=_local(weight).device)
    keep[module.padding_idx] = 0
    _local(weight).mul_(slice_of_full(keep.expand(weight.shape).contiguous(), weight))


def module_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode()) * 7_919) % (2**63)


class KeyMapper:
    """Checkpoint key -> model tensor name, as ``from_pretrained`` maps it: transformers' own rename
    tables (legacy names), then the base-model prefix added or dropped (GPT-2's original
    checkpoints say ``h.0.attn...``, the LM-head model ``transformer.h.0.attn...``). Keys that
    transformers merges or splits on load cannot be streamed slice by slice and are refused."""

    def __init__(self, rename: Callable[[str], tuple[str, Any]], expected: set[str], prefix: str) -> None:
        self.rename = rename
        self.expected = expected
        self.prefix = prefix or ""

    def expert_part(self, key: str) -> tuple[str, tuple[int, int, int] | None]:
        """A key of one expert's tensor that the model fuses (the hub's MoE layout): (the fused
        tensor's name, (expert, part, parts)); else (key, None)."""
        from fsdp_cli.compat.transformers_internals import expert_part

        name, converter = self.rename(key)
        part = None if converter is None else expert_part(converter, key)
        return (self._prefixed(name), part) if part is not None else (key, None)

    def __call__(self, key: str) -> str:
        name, converter = self.rename(key)
        if converter is not None:
            raise RuntimeError(
                f"checkpoint key {key!r} needs transformers' conversion "
                f"{getattr(converter, 'source_patterns', converter)!r}, which combines "
                "tensors and cannot be read shard by shard; save the model with current transformers first"
            )
        return self._prefixed(name)

    def _prefixed(self, name: str) -> str:
        if name in self.expected or not self.prefix:
            return name
        if name.startswith(self.prefix + ".") and name[len(self.prefix) + 1 :] in self.expected:
            return name[len(self.prefix) + 1 :]
        if f"{self.prefix}.{name}" in self.expected:
            return f"{self.prefix}.{name}"
        return name


class LayoutIndependentRandom(contextlib.ContextDecorator):
    """Random in-place fills (``normal_``, ``uniform_``, ... at the aten level, whoever calls them)
    of a DTensor draw the whole tensor from the global generator, as one unsharded process would,
    and keep this rank's slice.

    Without it, a shard on CPU draws the same numbers on every rank (no DTensor RNG tracker there:
    duplicated rows), and on GPUs nothing promises that shards equal an unsharded draw. It costs one
    full tensor of memory at a time.
    """

    def __init__(self, report: LoadReport | None = None) -> None:
        self.report = report
        self._mode: Any = None

    def __enter__(self) -> LayoutIndependentRandom:
        report = self.report

        class _WholeDraws(TorchDispatchMode):
            def __torch_dispatch__(
                self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
            ) -> Any:
                kwargs = kwargs or {}
                target = args[0] if args else None
                if _is_dtensor(target) and _fills_randomly(func):
                    local = target.to_local()
                    full = torch.empty(target.shape, dtype=target.dtype, device=local.device)
                    func(full, *args[1:], **kwargs)
                    if report is not None:
                        nbytes = full.numel() * full.element_size()
                        report.max_full_tensor_bytes = max(report.max_full_tensor_bytes, nbytes)
                    local.copy_(slice_of_full(full, target))
                    return target
                return func(*args, **kwargs)

        self._mode = _WholeDraws()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)


def _fills_randomly(func: Any) -> bool:
    tags = getattr(func, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags and torch.Tag.inplace in tags


def slice_of_full(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``like``'s local part of ``full`` (the whole tensor, the same on every rank), without communication."""
    from torch.distributed.tensor import distribute_tensor

    if not _is_dtensor(like):
        return full
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


def _copy_into(target: torch.Tensor, reader: Any, key: str, report: LoadReport) -> None:
    from fsdp_cli.parallel.nf4 import is_quantized, write_full

    shape = tuple(reader.get_slice(key).get_shape())
    if shape != tuple(target.shape):
        raise RuntimeError(f"{key}: checkpoint shape {shape} != model shape {tuple(target.shape)}")
    local = _local(target)
    box = _box(target) if shape else None
    if is_quantized(target):  # QLoRA's NF4 base: quantized whole, this rank's rows kept
        full = reader.get_tensor(key)
        report.max_full_tensor_bytes = max(report.max_full_tensor_bytes, full.numel() * full.element_size())
        report.tensors_read += 1
        report.bytes_read += full.numel() * full.element_size()
        write_full(target, full)
        return
    if box is not None:
        piece = reader.get_slice(key)[box]
        whole = all(s.start == 0 and s.stop == n for s, n in zip(box, shape))
    else:
        piece = slice_of_full(reader.get_tensor(key).to(target.dtype), target)
        whole = True
    if whole:
        report.max_full_tensor_bytes = max(
            report.max_full_tensor_bytes, target.numel() * target.element_size()
        )
    report.tensors_read += 1
    report.bytes_read += piece.numel() * piece.element_size()
    local.copy_(piece.to(target.dtype).reshape(local.shape))


def _copy_experts(
    target: torch.Tensor, parts: dict[tuple[int, int], tuple[Path, str]], report: LoadReport
) -> None:
    """A fused experts tensor ``[experts, ...]`` from one checkpoint tensor per expert (and part:
    ``gate_proj`` and ``up_proj`` concatenated into ``gate_up_proj``): only the experts this
    rank holds are read."""
    from safetensors import safe_open

    experts = target.shape[0]
    count = 1 + max(part for _, part in parts)
    wanted = [(e, p) for e in range(experts) for p in range(count)]
    lacking = [f"expert {e} part {p}" for e, p in wanted if (e, p) not in parts]
    if lacking or len(parts) != len(wanted):
        raise RuntimeError(
            f"the checkpoint's experts do not fill a tensor of {experts} experts "
            f"(lacking {', '.join(lacking[:4]) or 'nothing'}; {len(parts)} tensors for {len(wanted)})"
        )
    experts_at, rows_at = _expert_coordinates(target)
    needed = sorted(set(experts_at.flatten().tolist()))
    readers: dict[Path, Any] = {}
    wholes = []
    with contextlib.ExitStack() as stack:
        for expert in needed:
            pieces = []
            for part in range(count):
                file, key = parts[(expert, part)]
                if file not in readers:
                    readers[file] = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
                pieces.append(readers[file].get_tensor(key))
            whole = torch.cat(pieces, dim=0)
            if tuple(whole.shape) != tuple(target.shape[1:]):
                raise RuntimeError(
                    f"{parts[(expert, 0)][1]}: the checkpoint's expert {expert} is {tuple(whole.shape)}, "
                    f"the model's {tuple(target.shape[1:])}"
                )
            wholes.append(whole)
            report.tensors_read += count
            report.bytes_read += whole.numel() * whole.element_size()
    local = _local(target)
    if not needed:  # an empty shard
        return
    position = {expert: i for i, expert in enumerate(needed)}
    which = experts_at.clone().apply_(position.__getitem__)
    local.copy_(torch.stack(wholes)[which, rows_at].to(local.dtype).reshape(local.shape))


def _expert_coordinates(target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row of dim 1 of this rank's part of ``target`` (``[experts, rows, ...]``), the
    expert and the row of it it holds: all of them unsharded, else what a sharding along dims 0
    and 1 (expert parallel, FSDP2) gives this rank — so that only its experts are read."""
    experts, rows = target.shape[0], target.shape[1]
    grid = (
        torch.arange(experts).view(experts, 1).expand(experts, rows),
        torch.arange(rows).view(1, rows).expand(experts, rows),
    )
    if not _is_dtensor(target):
        return grid
    if any(p.is_shard() and getattr(p, "dim", 0) > 1 for p in target.placements):
        raise RuntimeError(
            f"experts sharded along {target.placements}: only their first two dimensions may be"
        )
    from torch.distributed.tensor import distribute_tensor

    return tuple(  # type: ignore[return-value]
        distribute_tensor(
            g.contiguous(), target.device_mesh, target.placements, src_data_rank=None
        ).to_local()
        for g in grid
    )


def _box(tensor: torch.Tensor) -> tuple[slice, ...] | None:
    """This rank's part of the full tensor as index ranges, when it is one box (plain Shard and
    Replicate placements); None for other placements (FSDP's strided shard over a tensor-parallel dim)."""
    from torch.distributed.tensor import Replicate, Shard

    if not _is_dtensor(tensor):
        return tuple(slice(0, n) for n in tensor.shape)
    if any(type(p) not in (Shard, Replicate) for p in tensor.placements):
        return None
    shape, offset = local_box(tensor)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint holds, by name: parameters (a tied one under each of its names) and persistent buffers."""
    out: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        out.update(_own_tensors(module, module_name))
    return out


def _own_tensors(module: nn.Module, module_name: str) -> dict[str, torch.Tensor]:
    """The module's own tensors a checkpoint of the model holds (LoRA pairs added beside fused
    experts are not the model's: their own init draws them)."""
    adapters = getattr(module, "expert_adapters", None)
    added = set(adapters.parameter_names()) if adapters is not None else set()
    prefix = f"{module_name}." if module_name else ""
    out = {
        canonical_name(prefix + name): p
        for name, p in module.named_parameters(recurse=False)
        if name not in added
    }
    skip = non_persistent_buffer_names(module)
    for name, buffer in module.named_buffers(recurse=False):
        if buffer is not None and name not in skip:
            out[canonical_name(prefix + name)] = buffer
    return out


def _fsdp2_managed(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _owners(model: nn.Module) -> dict[int, nn.Module]:
    """Each module's nearest ``PreTrainedModel`` (itself or an ancestor): whose ``_init_weights`` applies to it."""
    from transformers import PreTrainedModel

    owners: dict[int, nn.Module] = {}

    def visit(module: nn.Module, owner: nn.Module) -> None:
        owner = module if isinstance(module, PreTrainedModel) else owner
        owners[id(module)] = owner
        for child in module.children():
            visit(child, owner)

    visit(model, model)
    return owners


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module


def _recomputed_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for name in non_persistent_buffer_names(module):
        buffer = getattr(module, name, None)
        if isinstance(buffer, torch.Tensor) and buffer.is_floating_point():
            yield name, buffer


def _poison_recomputed_buffers(module: nn.Module) -> None:
    """NaN-fill buffers the checkpoint does not hold, so one the model's init forgets is caught, not trained on."""
    for _, buffer in _recomputed_buffers(module):
        buffer.fill_(float("nan"))


def _check_recomputed_buffers(modules: Sequence[nn.Module], names: dict[int, str]) -> None:
    bad = [
        f"{names.get(id(m), '?')}.{n}"
        for m in modules
        for n, b in _recomputed_buffers(m)
        if not torch.isfinite(b).all()
    ]
    if bad:
        raise RuntimeError(
            f"the model's _init_weights left buffers {bad} unset; they are not in the checkpoint"
        )


def _clear_marks(module: nn.Module) -> None:
    from fsdp_cli.compat.transformers_internals import clear_initialized

    clear_initialized(module)


def _is_dtensor(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _local_bytes(param: torch.Tensor) -> int:
    """What this rank's part of ``param`` holds (a QLoRA base weight: its 4-bit data and scales)."""
    from fsdp_cli.compat.torch_internals import storage_bytes
    from fsdp_cli.parallel.nf4 import is_quantized

    return storage_bytes([param]) if is_quantized(param) else _local(param).numel() * param.element_size()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if _is_dtensor(tensor) else tensor
