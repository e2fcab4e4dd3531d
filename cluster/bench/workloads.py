"""Prompt workloads shared by benchmarks and tests: held-out code, shared system prompts, random."""

from __future__ import annotations

import os
import random
import sysconfig
from pathlib import Path

from cluster.training.demo_data import SKIP_DIRS, is_held_out


def held_out_files(root: str | None = None) -> list[Path]:
    """Standard-library files the demo pair never trained on (the md5 rule of training.demo)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if name.endswith(".py") and is_held_out(path.relative_to(root).as_posix()):
                out.append(path)
    return out


def code_prompts(n: int, chars: int = 400, seed: int = 0) -> list[str]:
    """`n` prompts: `chars` characters starting at a random line of a random held-out file."""
    rng = random.Random(seed)
    files = held_out_files()
    prompts: list[str] = []
    while len(prompts) < n:
        try:
            lines = rng.choice(files).read_text(encoding="utf-8").splitlines(keepends=True)
        except (OSError, UnicodeDecodeError):
            continue
        if len(lines) < 40:
            continue
        start = rng.randrange(0, len(lines) - 30)
        text = "".join(lines[start:])[:chars]
        if text.strip():
            prompts.append(text)
    return prompts


def shared_prefix_prompts(n_prefixes: int, n_per_prefix: int, prefix_chars: int = 1200, seed: int = 0) -> list[tuple[int, str]]:
    """(prefix id, prompt): a few long shared 'system prompts' (held-out code) with short suffixes."""
    rng = random.Random(seed)
    prefixes = code_prompts(n_prefixes, prefix_chars, seed)
    out = [(i, prefixes[i] + f"\n# task {j}: {rng.choice(['parse', 'format', 'check', 'load'])} the input\ndef ")
           for i in range(n_prefixes) for j in range(n_per_prefix)]
    rng.shuffle(out)
    return out


def random_token_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(n)]
