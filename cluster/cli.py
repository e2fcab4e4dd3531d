"""`spec-cluster`: up | generate | models train-demo | models train-medusa | models train-eagle3 | bench."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time

from cluster.engine.drafters.registry import DRAFTERS


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, non-zero exit
        self.exit(2, f"spec-cluster: error: {message}\n")


def _speculation(value: str):
    if value in ("off", "auto"):
        return value
    try:
        g = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--speculation must be off, auto or an integer gamma, got {value!r}") from None
    if g < 0:
        raise argparse.ArgumentTypeError(f"--speculation gamma must be >= 0, got {g}")
    return g


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="spec-cluster", description="Speculative-decoding LLM serving cluster on Ray Serve.")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    up = sub.add_parser("up", help="start (or join) Ray and serve the cluster over gRPC and HTTP (OpenAI API)")
    up.add_argument("--config", help="cluster YAML (default: embedded demo config)")
    up.add_argument("--address", help="Ray address to join (default: $RAY_ADDRESS, else start a Ray of its own)")
    up.add_argument("--port", type=int, help="gRPC port (default from config: 9000)")
    up.add_argument("--http-port", type=int, help="HTTP port of the OpenAI-compatible API (default from config: 8000)")
    up.add_argument("--placement", choices=["colocated", "disaggregated"])
    up.add_argument("--num-cpus", type=int, help="CPUs for a local Ray")
    up.add_argument("--insecure", action="store_true",
                    help="serve on a non-loopback network.host without API keys (anyone who reaches it can generate)")

    g = sub.add_parser("generate", help="generate from a prompt (gRPC client, or --local in-process)")
    g.add_argument("prompt")
    g.add_argument("--local", action="store_true", help="run the engine in this process")
    g.add_argument("--address", help="gRPC address, host[:port] (default: $SPEC_CLUSTER_ADDRESS, else localhost:9000)")
    g.add_argument("--port", type=int, help="gRPC port (with --address's host, or localhost)")
    g.add_argument("--stream", action="store_true")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--speculation", type=_speculation, default="auto", help="off | auto | K (fixed gamma)")
    g.add_argument("--drafter", choices=list(DRAFTERS))
    g.add_argument("--target", help="target HF model directory (local mode)")
    g.add_argument("--draft", help="draft HF model directory (local mode)")
    g.add_argument("--config", help="cluster YAML for local mode")
    g.add_argument("--api-key")
    g.add_argument("--timeout", type=float, help="deadline in seconds")

    m = sub.add_parser("models", help="model utilities")
    msub = m.add_subparsers(dest="models_cmd", required=True, parser_class=_Parser)
    msub.add_parser("train-demo", help="train the demo target/drafter pair", add_help=False)
    msub.add_parser("train-medusa", help="train Medusa heads beside a target (--target DIR)", add_help=False)
    msub.add_parser("train-eagle3", help="train an EAGLE-3 head beside a target (--target DIR)", add_help=False)

    b = sub.add_parser("bench", help="benchmarks (see --help of each)", add_help=False)
    b.add_argument("bench_args", nargs=argparse.REMAINDER)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["models", "train-demo"]:
        from cluster.training.demo import main as train

        return train(argv[2:]) or 0
    if argv[:2] == ["models", "train-medusa"]:
        from cluster.training.medusa import main as train_medusa

        return train_medusa(argv[2:]) or 0
    if argv[:2] == ["models", "train-eagle3"]:
        from cluster.training.eagle3 import main as train_eagle3

        return train_eagle3(argv[2:]) or 0
    if argv[:1] == ["bench"]:
        from cluster.bench.cli import main as bench

        return bench(argv[1:]) or 0
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return {"up": cmd_up, "generate": cmd_generate}[args.cmd](args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # one line for the user; -v for the traceback
        if args.verbose:
            raise
        code = getattr(e, "code", None)
        msg = f"{code().name}: {e.details()}" if callable(code) and hasattr(e, "details") else str(e).splitlines()[0]
        print(f"spec-cluster: error: {msg}", file=sys.stderr)
        return 1


def _overrides(args) -> dict:
    o: dict = {}
    if getattr(args, "target", None):
        o.setdefault("models", {})["target"] = args.target
    if getattr(args, "draft", None):
        o.setdefault("models", {})["draft"] = args.draft
    if getattr(args, "port", None):
        o.setdefault("network", {})["grpc_port"] = args.port
    if getattr(args, "http_port", None):
        o.setdefault("network", {})["http_port"] = args.http_port
    if getattr(args, "placement", None):
        o["placement"] = args.placement
    return o


def cmd_up(args) -> int:
    from cluster.config import load_config

    cfg = load_config(args.config, _overrides(args))  # a bad config stops here, before Ray is touched
    from cluster.serve.launch import deploy, open_to_network, shutdown

    if open_to_network(cfg) and not args.insecure:
        raise ValueError(f"network.host {cfg.network.host} serves generation to other hosts and no API keys are set: "
                         "set router.api_keys or router.api_keys_env, or pass --insecure")

    info = deploy(cfg, address=args.address, num_cpus=args.num_cpus)
    print(f"spec-cluster ready: gRPC {info['grpc']} (app {cfg.network.app_name}), "
          f"HTTP (OpenAI API) {info['http']}, Ray dashboard {info['dashboard'] or 'n/a'}; Ctrl-C to stop", flush=True)
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):  # Ray's driver setup may replace Python's SIGINT handler
        signal.signal(sig, lambda *_: stop.append(1))
    try:
        while not stop:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    print("spec-cluster: shutting down", flush=True)
    shutdown()
    return 0


def _spec_kwargs(args) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                seed=args.seed, stop=args.stop)


def cmd_generate(args) -> int:
    if args.local:
        result = _generate_local(args)
    else:
        result = _generate_remote(args)
    if result is None:
        return 0
    if args.json:
        print(json.dumps(result))
    else:
        print(result["text"])
    return 0


def _generate_local(args) -> dict | None:
    from cluster.config import load_config
    from cluster.engine.sampling import SamplingParams
    from cluster.engine.scheduling.sequence import SpecParams
    from cluster.serve.build import build_engine

    over = _overrides(args)
    if args.target and not args.draft:
        over.setdefault("models", {}).update(draft=None, drafter="ngram")
    cfg = load_config(args.config, over)
    params = SamplingParams(**_spec_kwargs(args))
    params.validate()  # refuse bad arguments before loading any weights
    engine = build_engine(cfg)  # with engine.tensor_parallel_size > 1 it starts the other ranks
    try:
        spec = args.speculation
        spec = SpecParams("fixed", spec) if isinstance(spec, int) else SpecParams(spec)
        sid = engine.add_request(args.prompt, params, spec, args.drafter)
        out = {"text": "", "token_ids": []}
        while engine.has_work:
            for o in engine.step():
                if o.seq_id != sid:
                    continue
                if args.stream and not args.json:
                    print(o.text, end="", flush=True)
                out["text"] += o.text
                out["token_ids"] += o.token_ids
                if o.finished:
                    out.update(finish_reason=o.finish_reason, **o.stats)
    finally:
        engine.close()
    if args.stream and not args.json:
        print()
        return None
    return out


def _as_json(msg) -> dict:
    from google.protobuf.json_format import MessageToDict

    d = MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    for k in ("drafted", "accepted", "verify_steps"):  # int64 comes back as a string in proto JSON
        if k in d.get("spec", {}):
            d["spec"][k] = int(d["spec"][k])
    return d


def _generate_remote(args) -> dict | None:
    from cluster.client import Client, server_address

    kw = dict(_spec_kwargs(args), speculation=args.speculation, drafter=args.drafter or "")
    with Client(server_address(args.address, args.port), timeout=args.timeout, api_key=args.api_key) as c:
        if args.stream:
            last = None
            text, ids = "", []
            for chunk in c.generate_stream(args.prompt, **kw):
                if not args.json:
                    print(chunk.text, end="", flush=True)
                text += chunk.text
                ids += list(chunk.token_ids)
                last = chunk
            if not args.json:
                print()
                return None
            d = _as_json(last)
            d.update(text=text, token_ids=ids)
            d.pop("final", None)
            return d
        return _as_json(c.generate(args.prompt, **kw))


if __name__ == "__main__":
    sys.exit(main())
