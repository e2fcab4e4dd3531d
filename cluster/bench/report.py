"""Benchmark output: one JSON file and one PNG per run, with the command that made them."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path


def environment() -> dict:
    import torch

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {"python": sys.version.split()[0], "torch": torch.__version__, "device": dev,
            "cpus": __import__("os").cpu_count(), "command": " ".join(sys.argv)}


def write_json(out_dir: str | Path, name: str, data: dict) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(), **data}, indent=2))
    return path


def figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path, *axes) -> None:
    """A finished plot: the axes' legends, laid out, saved as a PNG at `path`."""
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
