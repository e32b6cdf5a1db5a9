"""``self.clip_gradients(opt, gradient_clip_algorithm="norm")`` by the global norm of sharded
parameters, for the strategies whose gradients Lightning's plugins cannot total: FSDP1 (Lightning's
FSDPPrecision refuses norm clipping: it has no reference to the root, which alone can total flat
sharded gradients) and FSDP2 / tensor parallel (DTensor gradients on more than one mesh)."""

from __future__ import annotations

from typing import Any

from fsdp_cli.parallel.grad_norm import clip_grad_norm


class GlobalNormClipping:
    """Mixin for a Lightning Strategy: its precision plugin clips by norm through
    :func:`fsdp_cli.parallel.grad_norm.clip_grad_norm`. Clipping by value is elementwise and
    left to Lightning."""

    model: Any
    precision_plugin: Any

    def setup_precision_plugin(self) -> None:
        super().setup_precision_plugin()  # type: ignore[misc]
        plugin = self.precision_plugin

        def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
            # The plugin's own method (public Lightning API), replaced on this instance only: the
            # plugin class is Lightning's choice for the precision and must stay it.
            across = getattr(self, "pipeline_group", None)  # the other stages' gradients
            clip_grad_norm(self.model, plugin.main_params(optimizer), clip_val, across=across)

        plugin.clip_grad_by_norm = clip_grad_by_norm
