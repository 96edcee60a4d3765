"""fp4moe.explain: the tile planner's verdict (include/fp4moe/planner.hpp) as a dict, as `fp4moe explain`
prints it."""
from __future__ import annotations

from typing import Any, Optional

from ._loader import ext as _ext
from .config import make_config

KERNELS = ("sm80-nvfp4-grouped", "cutlass-sm120-nvfp4-grouped")


def explain(tile: Optional[str] = None, *, arch: Optional[str] = None, kernel: str = "sm80-nvfp4-grouped",
            stages: int = 0, warps: int = 0, wgmma: bool = False, model: Any = None, tokens: int = 1,
            sms: int = 0, epilogue_bytes: int = -1) -> dict:  # epilogue_bytes: the StageCountAutoCarveout carveout (cutlass family)
    """The planner's arithmetic for one tile config, or for every config of the kernel family.

    tile: "BNxBTxBK" for sm80-nvfp4-grouped (features x tokens x K), "MxNxK" for the CUTLASS sm_120
        model; None: every config (sm80: with the pick for `model` at `tokens`).
    arch: "sm_90", "sm_120", ... (default: the present GPU, else sm_90). model: a preset name, a
        config dict / path or a Config; adds the problem's tiles and waves (with a tile) or the
        configs the tuner table / heuristic picks (without).
    Returns {"arch": {...}, "kernel": ..., "verdict": {"valid", "reason", "failures"}, ...}: with a tile,
    "config", "smem" (lines with formulas), "registers", "occupancy" and "problem"; without, "configs" and
    "picks"; for the CUTLASS model, "plans".
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel = '{kernel}': known kernel families are {', '.join(KERNELS)}")
    cfg = None if model is None else make_config(model)
    return _ext.explain(tile, arch, kernel, int(stages), int(warps), bool(wgmma), cfg, int(tokens), int(sms),
                        int(epilogue_bytes))
