"""Model FLOPs per token, device peaks, and the ``tflops_per_s`` / ``mfu`` fields of metrics.jsonl.

* FLOPs per token: for the built-in Llama the standard estimate ``6 * N + 12 * L * d * T`` (N the
  parameters that take part in matrix multiplies: all but the input embedding and the norms; L layers, d
  the model width, T the sequence length: the attention scores and their weighted sum, forward and
  backward, counted over the full T x T as PaLM and torchtitan do). For any other ``nn.Module``,
  counted once with ``torch.utils.flop_counter.FlopCounterMode`` on a meta-device copy (forward,
  loss and backward of one sequence), so no memory or compute is spent on it.
* Peak: dense (no sparsity) tensor-core TFLOP/s of common GPUs by name and the compute dtype in
  effect (a 32-true run with a bf16 ``mp_policy`` computes in bf16: the bf16 peak), or
  ``trainer.peak_tflops``. A CPU has no entry: mfu stays null unless a peak is given.
* Per rank: ``tflops_per_s = flops_per_token * tokens_per_s / world_size``; ``mfu`` is that over
  the peak. (Tensor-parallel ranks share each sequence's FLOPs, data-parallel ranks the batch:
  either way each rank does 1/world of the work.)
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_cli.models.flops import counted_flops_per_token, llama_flops_per_token

__all__ = ["counted_flops_per_token", "llama_flops_per_token"]  # (their home is models/flops.py)

# Dense TFLOP/s per device: (bf16/fp16 tensor cores, fp32 without TF32). Matched by substring of
# the CUDA device name, most specific first.
PEAK_TFLOPS: list[tuple[str, float, float]] = [
    ("GB200", 2500.0, 80.0),
    ("B200", 2250.0, 80.0),
    ("H200", 989.5, 66.9),
    ("H100 PCIe", 756.5, 51.2),
    ("H100", 989.5, 66.9),  # SXM
    ("H800", 989.5, 66.9),
    ("GH200", 989.5, 66.9),
    ("A100", 312.0, 19.5),
    ("A800", 312.0, 19.5),
    ("L40S", 362.1, 91.6),
    ("L40", 181.0, 90.5),
    ("L4", 121.0, 30.3),
    ("A10G", 70.0, 31.2),
    ("A10", 125.0, 31.2),
    ("RTX 4090", 165.2, 82.6),
    ("RTX 3090", 71.0, 35.6),
    ("V100", 125.0, 15.7),
    ("T4", 65.0, 8.1),
]


def device_peak_tflops(device_name: str, compute: str) -> float | None:
    """The table's dense peak for a device name (``torch.cuda.get_device_name()``) and the dtype
    matrix multiplies run in (``bfloat16``: what the run resolved, an explicit mixed-precision
    policy included; a precision name stands for its own compute dtype)."""
    from fsdp_cli.precision import ALIASES, PRECISIONS, precision_spec

    compute_dtype = (
        precision_spec(compute).compute if compute in PRECISIONS or compute in ALIASES else compute
    )
    for key, low, full in PEAK_TFLOPS:
        if key in device_name:
            return {"bfloat16": low, "float16": low, "float32": full}.get(compute_dtype)
    return None


@dataclass
class Throughput:
    """Turns tokens/s (global) into this run's per-rank TFLOP/s and MFU."""

    flops_per_token: float | None
    world_size: int
    peak_tflops: float | None

    def fields(self, tokens_per_s: float) -> dict[str, float | None]:
        if self.flops_per_token is None:
            return {"tflops_per_s": None, "mfu": None}
        tflops = self.flops_per_token * tokens_per_s / self.world_size / 1e12
        mfu = tflops / self.peak_tflops if self.peak_tflops else None
        return {"tflops_per_s": tflops, "mfu": mfu}
