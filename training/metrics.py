"""Throughput, MFU and metric sinks (JSONL, TensorBoard).

MFU = model FLOPs per step (``cfg.flops_per_token(T)`` × tokens: 6·N plus causal attention)
÷ (step time × number of devices × peak FLOP/s per device). Peaks are dense bf16 figures from
the vendors' data sheets; on CPU (or an unknown chip) MFU is reported as "n/a".

    >>> peak_flops_per_device("NVIDIA H100 80GB HBM3")
    989000000000000.0
"""
from __future__ import annotations

import json
import os
import sys
from typing import Optional

from tqdm import tqdm

# Dense bf16 peak FLOP/s per device, matched by substring of ``device.device_kind``
# (first match wins, so more specific names come first).
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("gb200", 2.5e15), ("b200", 2.25e15), ("h200", 989e12), ("h100 pcie", 756e12),
    ("h100", 989e12), ("h800", 989e12), ("gh200", 989e12), ("a100", 312e12), ("a800", 312e12),
    ("l40s", 362e12), ("l4", 121e12), ("a10g", 70e12), ("v100", 125e12),
    ("mi300x", 1307e12), ("mi250", 362e12),
    ("tpu v6", 918e12), ("tpu v5p", 459e12), ("tpu v5 lite", 197e12), ("tpu v5e", 197e12),
    ("tpu v4", 275e12), ("tpu v3", 123e12),
)


def peak_flops_per_device(device_kind: str) -> Optional[float]:
    kind = device_kind.lower()
    for key, peak in PEAK_FLOPS:
        if key in kind:
            return peak
    return None


def mfu(flops_per_step: float, step_time_s: float, num_devices: int,
        peak_per_device: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation in [0, 1], or None when the peak is unknown (e.g. CPU)."""
    if not peak_per_device or step_time_s <= 0:
        return None
    return flops_per_step / (step_time_s * num_devices * peak_per_device)


def fmt_mfu(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.1%}"


class MetricSinks:
    """JSONL (one object per optimizer step) and optional TensorBoard, on process 0 only."""

    def __init__(self, log_json: Optional[str], tensorboard: Optional[str], enabled: bool,
                 append: bool = False, note=print):
        self._json = None
        self._tb = None
        if not enabled:
            return
        if log_json:
            os.makedirs(os.path.dirname(os.path.abspath(log_json)), exist_ok=True)
            self._json = open(log_json, "a" if append else "w", encoding="utf-8")
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                note("triax train: tensorboardX is not installed; skipping TensorBoard logs "
                     "(pip install tensorboardX)")
            else:
                self._tb = SummaryWriter(tensorboard)

    def write(self, record: dict) -> None:
        if self._json is not None:
            self._json.write(json.dumps(record) + "\n")
            self._json.flush()
        if self._tb is not None:
            step = record["step"]
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and v is not None:
                    self._tb.add_scalar(f"train/{k}" if k != "val_loss" else "eval/loss", v, step)

    def close(self) -> None:
        if self._json is not None:
            self._json.close()
        if self._tb is not None:
            self._tb.close()


def progress_bar(total: int, initial: int, enabled: bool):
    """A tqdm bar on stderr (disabled on non-zero processes or with --no-progress)."""
    return tqdm(total=total, initial=initial, disable=not enabled, unit="step",
                dynamic_ncols=True, file=sys.stderr, leave=True)
