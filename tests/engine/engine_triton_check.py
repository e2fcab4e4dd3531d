"""Run by test_paged_attention.py under Triton's interpreter: the whole engine with the
paged Triton kernel as its attention (as on a GPU) against the same engine on SDPA, fp32, on
a tiny random model: greedy plain decoding, speculation, and a pool small enough to preempt."""

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import CharTokenizer, save_random  # noqa: E402
from gemv_check import interpreter_works, numpy24_index  # noqa: E402

numpy24_index()
from cluster.engine.config import EngineConfig  # noqa: E402
from cluster.engine.drafters.ngram import NgramDrafter  # noqa: E402
from cluster.engine.engine import Engine  # noqa: E402
from cluster.engine.sampling import SamplingParams  # noqa: E402
from cluster.engine.scheduling.kv_cache import block_bytes  # noqa: E402
from cluster.engine.scheduling.sequence import SpecParams  # noqa: E402
from cluster.engine.worker.loader import load_model  # noqa: E402

PROMPTS = ["def f(x):\n    return f(x)\n\ndef f(", "abcabcabcabcabc", "z", "the quick brown fox " * 3]


def main() -> int:
    if not interpreter_works():
        print("the Triton interpreter cannot run here")
        return 77
    path = save_random(Path(tempfile.mkdtemp()) / "llama", "llama")
    model = load_model(path, torch.float32, "cpu")
    s = model.shape
    outs = {}
    for attention in ("sdpa", "triton"):
        model.backend = None
        for name, gb in (("roomy", None), ("tight", 40 * block_bytes(s.layers, 4, s.kv_heads, s.head_dim, torch.float32) / 2**30)):
            cfg = EngineConfig(max_num_seqs=4, max_model_len=96, block_size=4, max_batch_tokens=64, prefill_chunk=16,
                               attention=attention, kv_cache_gb=gb)
            e = Engine(model, CharTokenizer(), cfg, {"ngram": NgramDrafter()}, "ngram")
            assert e.backend == attention, e.backend
            for spec in (SpecParams("off"), SpecParams("fixed", 3)):
                r = e.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True), spec)
                outs[(attention, name, spec.mode)] = [x["token_ids"] for x in r]
            assert e.kv.held() == (0, 0), e.kv.held()
            if name == "tight":
                assert e.scheduler.preemptions > 0, "the tight pool never preempted"
    ref = outs[("sdpa", "roomy", "off")]
    bad = [k for k, v in outs.items() if v != ref]
    if bad:
        print("differ from sdpa plain:", bad)
        return 1
    print(f"{len(outs)} runs identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
