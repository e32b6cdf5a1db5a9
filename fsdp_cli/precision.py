"""Precision names and the dtypes they mean: the one table every part of fsdp_cli asks.

A precision is named as Lightning names it (``bf16-mixed``, ``32-true``, ...). :data:`PRECISIONS`
says, for each, the dtype parameters are stored in, the dtype matrix multiplies run in, the dtype
gradients are reduced in, whether it needs a GPU, whether it scales the loss and whether the
sharded strategies take it; old names
(``16``, ``bf16``, ``32``, ``64``) are aliases of today's. :func:`resolve_precision` turns a name
plus a strategy's explicit mixed-precision policy (FSDP2's ``mp_policy``, FSDP1's
``mixed_precision``) into the dtypes actually in effect, once per run: validation, the builders,
the memory plan, MFU's device peak and the reports all read that one object.

Dtypes are names (``"bfloat16"``), so this module imports neither torch nor the CLI's schema.
"""

from __future__ import annotations

from typing import NamedTuple

from fsdp_cli.errors import ConfigError

FLOAT32, BFLOAT16, FLOAT16, FLOAT64 = "float32", "bfloat16", "float16", "float64"
DTYPE_BYTES = {FLOAT32: 4, BFLOAT16: 2, FLOAT16: 2, FLOAT64: 8}
AUTO = "auto"


class PrecisionSpec(NamedTuple):
    """What a precision name means. (The types here are named tuples: the config-only commands
    import this module, and a frozen dataclass costs ten times as much to define.)"""

    name: str
    param: str
    """Dtype the parameters (and the optimizer state that follows them) are stored in."""
    compute: str
    """Dtype matrix multiplies run in (all-gathers too, under an FSDP mixed-precision policy)."""
    reduce: str
    """Dtype gradients are reduced (all-reduced / reduce-scattered) in."""
    mixed: bool = False
    """Low-precision compute over fp32 parameters: realised by an FSDP mixed-precision policy
    (fsdp2, fsdp) or by autocast (ddp, model_parallel)."""
    gpu_only: bool = False
    """float16 needs a GPU."""
    loss_scaling: bool = False
    """Lightning scales the loss (a GradScaler skips steps whose gradients overflow)."""
    shardable: bool = True
    """Lightning's sharded strategies (FSDPStrategy, ModelParallelStrategy, so fsdp2, fsdp and
    model_parallel) train in it; they refuse float64 on every rank, which leaves 64-true to ddp."""
    aliases: tuple[str, ...] = ()
    """Older names of the same precision (Lightning 1.x: ``16``, ``bf16``, ``32``, ``64``)."""

    @property
    def fixes_param_dtype(self) -> bool:
        """A ``*-true`` precision other than fp32: the parameters already are the compute dtype,
        so an explicit mixed-precision ``param_dtype`` contradicts it."""
        return not self.mixed and self.param != FLOAT32


PRECISIONS: dict[str, PrecisionSpec] = {
    spec.name: spec
    for spec in (
        PrecisionSpec("32-true", FLOAT32, FLOAT32, FLOAT32, aliases=("32",)),
        PrecisionSpec("bf16-mixed", FLOAT32, BFLOAT16, FLOAT32, mixed=True, aliases=("bf16",)),
        PrecisionSpec("bf16-true", BFLOAT16, BFLOAT16, BFLOAT16),
        PrecisionSpec(
            "16-mixed",
            FLOAT32,
            FLOAT16,
            FLOAT32,
            mixed=True,
            gpu_only=True,
            loss_scaling=True,
            aliases=("16",),
        ),
        PrecisionSpec("16-true", FLOAT16, FLOAT16, FLOAT16, gpu_only=True),
        PrecisionSpec("64-true", FLOAT64, FLOAT64, FLOAT64, shardable=False, aliases=("64",)),
    )
}
ALIASES: dict[str, str] = {alias: spec.name for spec in PRECISIONS.values() for alias in spec.aliases}


class UnknownPrecision(ValueError):
    """A name that is neither a precision of :data:`PRECISIONS`, an alias, nor ``auto``."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"unknown precision {name!r}; allowed: {', '.join(PRECISIONS)}, {AUTO}")


def precision_spec(name: str) -> PrecisionSpec:
    """The spec of a precision name or alias; :class:`UnknownPrecision` otherwise."""
    spec = PRECISIONS.get(ALIASES.get(name, name))
    if spec is None:
        raise UnknownPrecision(name)
    return spec


def check_precision_name(name: str, *, on_cpu: bool) -> None:
    """A name this table knows, and one these processes can train in (float16 needs a GPU)."""
    try:
        spec = precision_spec(name)
    except UnknownPrecision:
        raise ConfigError(
            "precision", name, "unknown precision", allowed=", ".join([*PRECISIONS, AUTO])
        ) from None
    if spec.gpu_only and on_cpu:
        usable = [p.name for p in PRECISIONS.values() if not p.gpu_only]
        raise ConfigError(
            "precision",
            name,
            "float16 needs a GPU",
            allowed=", ".join(usable) + " on CPU",
            hint="use precision=bf16-mixed",
        )


def auto_precision(on_gpu: bool) -> str:
    """What ``precision=auto`` means: bf16-mixed on GPUs, 32-true on CPU processes."""
    return "bf16-mixed" if on_gpu else "32-true"


def stored_dtype(name: str) -> str:
    """The dtype precision ``name`` stores parameters in (``auto``: float32, on GPUs and CPUs alike)."""
    return precision_spec(auto_precision(False) if name == AUTO else name).param


class PolicyDtypes(NamedTuple):
    """An explicit mixed-precision policy as a strategy's config gives it (None = not set)."""

    param: str | None = None
    reduce: str | None = None
    output: str | None = None
    cast_forward_inputs: bool = True


class ResolvedPrecision(NamedTuple):
    """The dtypes in effect for a run: the precision's own, with an explicit policy applied."""

    spec: PrecisionSpec
    compute: str
    reduce: str
    policy: PolicyDtypes
    """The mixed-precision policy handed to FSDP (its None fields: none in effect)."""

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def param(self) -> str:
        return self.spec.param

    @property
    def low_precision_compute(self) -> bool:
        """Matrix multiplies run in a 16-bit dtype (what a GPU's tensor-core peak is quoted for)."""
        return self.compute in (BFLOAT16, FLOAT16)

    def bytes(self) -> tuple[int, int, int]:
        """Bytes per element of (stored parameters, compute, reduction)."""
        return DTYPE_BYTES[self.param], DTYPE_BYTES[self.compute], DTYPE_BYTES[self.reduce]


def resolve_precision(name: str, explicit: PolicyDtypes | None = None) -> ResolvedPrecision:
    """The dtypes of precision ``name`` under a strategy's explicit policy (fields that are set win).

    ``*-mixed`` implies a policy of low-precision parameters for compute and fp32 reduction;
    other precisions imply none. ``explicit`` is None for strategies that take no policy (ddp,
    model_parallel): then the precision alone decides."""
    spec = precision_spec(name)
    implied = PolicyDtypes(param=spec.compute, reduce=spec.reduce) if spec.mixed else PolicyDtypes()
    given = explicit or PolicyDtypes()
    policy = PolicyDtypes(
        param=given.param or implied.param,
        reduce=given.reduce or implied.reduce,
        output=given.output or implied.output,
        cast_forward_inputs=given.cast_forward_inputs,
    )
    # FSDP (1 and 2) reduce in the parameter dtype of the policy when it names no reduce dtype.
    compute = policy.param or spec.compute
    reduce = policy.reduce or policy.param or spec.reduce
    return ResolvedPrecision(spec=spec, compute=compute, reduce=reduce, policy=policy)
