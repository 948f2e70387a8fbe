"""Number formats and the declarative mixed-precision policy.

Master weights and optimizer states are always FP32; the policy says in which dtype parameters are
gathered and computed on (``param_dtype``), gradients are communicated (``reduce_dtype``) and
buffers are kept (``buffer_dtype``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MASTER_DTYPE = torch.float32


@dataclass(frozen=True, kw_only=True)
class MixedPrecision:
    """Which dtype each kind of tensor uses; ``None`` keeps the model's own dtype."""

    param_dtype: torch.dtype | None = None
    """Dtype of gathered parameters, forward and backward compute, and the parameter all-gather."""
    reduce_dtype: torch.dtype | None = None
    """Dtype of gradient reduction (defaults to ``param_dtype``)."""
    buffer_dtype: torch.dtype | None = None
    """Dtype of module buffers (e.g. running statistics)."""
    output_dtype: torch.dtype | None = None
    """Dtype the root's floating-point outputs are cast to (``None``: left as computed)."""
    cast_root_inputs: bool = True
    """Cast the root's floating-point inputs to ``param_dtype``."""

    def resolved(self, model_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
        """``(param_dtype, reduce_dtype)`` with defaults filled in from the model's dtype."""
        param = self.param_dtype or model_dtype
        return param, self.reduce_dtype or param


FP32 = MixedPrecision()
