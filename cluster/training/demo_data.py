"""Demo-pair data: the Python standard library's source, its held-out and validation
splits, and the BPE tokenizer trained on it (see cluster.training.demo)."""


import hashlib
import os
import sysconfig
from pathlib import Path

import torch
from tqdm import tqdm

EOS = "<|endoftext|>"
VOCAB_SIZE = 4096
SEQ_LEN = 512
MAX_FILE_BYTES = 1_000_000
MAX_TOTAL_BYTES = 15_000_000
# Left out of benchmark prompts and head training: the demo pair was trained on an image whose
# stdlib has no test suites, so they are a different distribution from what it learned.
SKIP_DIRS = {"site-packages", "__pycache__", "test", "tests", "idle_test"}

# --------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------


def is_held_out(rel_path: str) -> bool:
    """The held-out rule: 1 file in 20, by the md5 of its stdlib-relative path."""
    return int(hashlib.md5(rel_path.encode()).hexdigest(), 16) % 20 == 0


def is_validation(rel_path: str) -> bool:
    """Another 1 file in 20 (never a held-out one), kept out of training for model selection."""
    return int(hashlib.md5(rel_path.encode()).hexdigest(), 16) % 20 == 1


def stdlib_files(root: str | None = None) -> dict[str, list[tuple[str, str]]]:
    """{"train", "val", "held"} lists of (relative_path, text), sorted by path."""
    root = root or sysconfig.get_paths()["stdlib"]
    split: dict[str, list[tuple[str, str]]] = {"train": [], "val": [], "held": []}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "site-packages" and d != "__pycache__")
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            try:
                if os.path.getsize(path) > MAX_FILE_BYTES:
                    continue
                text = Path(path).read_bytes().decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if EOS in text or not text.strip():
                continue
            key = "held" if is_held_out(rel) else "val" if is_validation(rel) else "train"
            split[key].append((rel, text))
    for v in split.values():
        v.sort()
    return split


def train_tokenizer(texts: list[str]):
    """Byte-level BPE (GPT-2 style pre-tokenizer, no prefix space) -> PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tqdm(texts, desc="tokenizer: train BPE", unit="file"), trainer=trainer, length=len(texts))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    return fast


def encode_docs(tokenizer, texts: list[str], desc: str) -> torch.Tensor:
    """Token ids of all texts, each followed by the EOS separator, as one int32 tensor."""
    backend = tokenizer.backend_tokenizer
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    batch = 64
    with tqdm(total=len(texts), desc=desc, unit="file") as bar:
        for i in range(0, len(texts), batch):
            for enc in backend.encode_batch(texts[i : i + batch], add_special_tokens=False):
                ids.extend(enc.ids)
                ids.append(eos_id)
            bar.update(len(texts[i : i + batch]))
    return torch.tensor(ids, dtype=torch.int32)


def check_roundtrip(tokenizer, texts: list[str]) -> None:
    samples = [
        "def f(x):\n    return x  # comment\n\n\tif a:\n        pass\n",
        "  leading  spaces\r\n\n\n  x = {'a': [1, 2]}  \n",
        "é ü ∑ 中文 \"\"\"doc\"\"\"\n",
    ] + [t[:3000] for t in texts[:20]]
    for s in samples:
        ids = tokenizer.encode(s, add_special_tokens=False)
        back = tokenizer.decode(ids)
        if back != s:
            raise RuntimeError(f"tokenizer round-trip failed for {s[:80]!r} -> {back[:80]!r}")


