"""Shape helpers shared by the row-wise kernels."""

from __future__ import annotations

import torch


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous ``[rows, last_dim]`` matrix."""
    return t.contiguous().view(-1, t.shape[-1])


def grid_programs(n_rows: int, device: torch.device) -> tuple[int, int]:
    """(programs, rows per program) for kernels that reduce a per-column partial over rows."""
    if device.type == "cuda":
        target = torch.cuda.get_device_properties(device).multi_processor_count * 4
    else:
        target = 4  # interpreter: few programs, each looping over many rows
    programs = max(1, min(n_rows, target))
    rows_per_program = -(-n_rows // programs)
    programs = -(-n_rows // rows_per_program)
    return programs, rows_per_program
