"""Round trip of the verifier -> drafter hop, the one remote call on the decode critical path:
through Serve's request path (actor transport, and Serve's gRPC transport), a direct gRPC
call (the transport this project used before), and the direct ZeroMQ call the verifier
makes (cluster.serve.draft_rpc), all with the same protobuf messages. The drafter replica
answers at once, so the figures are transport alone. A direct call sends a sequence's tokens
once and then only those accepted since; its first call per sequence carries the whole
context. Calls come from a plain thread inside a replica, as the verifier's engine loop
makes them.

    python -m cluster.bench.hop_bench --out benchmarks/hop
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import numpy as np

from cluster.bench.report import figure, write_json

TRANSPORTS = ("serve handle", "serve handle, gRPC transport", "direct gRPC, new tokens",
              "ZeroMQ, whole context", "ZeroMQ, new tokens (as sent)")


def _reply(n: int):
    from cluster.engine.drafters.base import DraftOutput, one_hot

    hot = [one_hot([7] * 4) for _ in range(n)]
    return DraftOutput([[7] * 4] * n, [h[0] for h in hot], [h[1] for h in hot])


def _grpc_server(propose_from, host: str):
    """The same call as a gRPC unary method (a generic handler: no service in the proto)."""
    from concurrent import futures

    import grpc

    from cluster.proto import drafting_pb2 as pb
    from cluster.serve.draft_rpc import decode_request, encode_output

    method = grpc.unary_unary_rpc_method_handler(
        lambda req, ctx: encode_output(*propose_from(*decode_request(req))),
        request_deserializer=pb.ProposeRequest.FromString, response_serializer=pb.ProposeReply.SerializeToString)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("hop.Drafting", {"Propose": method}),))
    port = server.add_insecure_port(f"{host}:0")
    server.start()
    return server, f"{host}:{port}"


def _grpc_call(address: str):
    import grpc

    from cluster.proto import drafting_pb2 as pb
    from cluster.serve.draft_rpc import decode_output, encode_request

    stub = grpc.insecure_channel(address).unary_unary(
        "/hop.Drafting/Propose", request_serializer=pb.ProposeRequest.SerializeToString,
        response_deserializer=pb.ProposeReply.FromString)
    return lambda reqs, starts: decode_output(stub.future(encode_request(reqs, starts, [], "v"), timeout=5.0).result())


def _deployments():
    import ray
    from ray import serve

    @serve.deployment(name="HopDrafter")
    class HopDrafter:
        def __init__(self):
            from cluster.serve.draft_rpc import DraftServer

            self.server = DraftServer(self.propose_from, ray.util.get_node_ip_address())
            self.grpc_server, self.grpc_address = _grpc_server(self.propose_from, ray.util.get_node_ip_address())

        def propose(self, requests, release, caller):
            return _reply(len(requests))

        def propose_from(self, requests, starts, release, caller):
            return _reply(len(requests)), [False] * len(requests)

        def endpoint(self) -> tuple[str, str]:
            return self.server.address, self.grpc_address

    @serve.deployment(name="HopVerifier")
    class HopVerifier:
        def __init__(self, drafter):
            self.drafter = drafter

        def run(self, calls: int, batch: int, context: int) -> dict:
            from cluster.engine.drafters.base import DraftRequest
            from cluster.serve.draft_rpc import DraftingClient

            reqs = [DraftRequest(f"s{i}", list(range(context)), 4) for i in range(batch)]
            address, grpc_address = self.drafter.endpoint.remote().result()
            client, grpc_call = DraftingClient(address), _grpc_call(grpc_address)
            grpc_handle = self.drafter.options(_by_reference=False)
            new = [context - 5] * batch  # after its first call a sequence sends those accepted since
            send = {TRANSPORTS[0]: lambda: self.drafter.propose.remote(reqs, [], "v").result(),
                    TRANSPORTS[1]: lambda: grpc_handle.propose.remote(reqs, [], "v").result(),
                    TRANSPORTS[2]: lambda: grpc_call(reqs, new),
                    TRANSPORTS[3]: lambda: client.propose(reqs, [0] * batch, [], "v", 5.0).result(),
                    TRANSPORTS[4]: lambda: client.propose(reqs, new, [], "v", 5.0).result()}
            out = {}

            def loop():  # a plain thread, like the engine loop (not the replica's event loop)
                for name, fn in send.items():
                    for _ in range(20):
                        fn()
                    ms = []
                    for _ in range(calls):
                        t0 = time.perf_counter()
                        fn()
                        ms.append(1e3 * (time.perf_counter() - t0))
                    out[name] = ms

            t = threading.Thread(target=loop)
            t.start()
            t.join()
            client.close()
            return out

    return HopVerifier.bind(HopDrafter.bind())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/hop")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--batches", default="1,16,64", help="sequences per draft call")
    ap.add_argument("--context", type=int, default=2048, help="tokens per sequence")
    args = ap.parse_args(argv)
    import ray
    from ray import serve
    from tqdm.auto import tqdm

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    handle = serve.run(_deployments(), name="hop-bench", route_prefix=None)
    results = {}
    for b in tqdm([int(x) for x in args.batches.split(",")], desc="hop bench"):
        raw = handle.run.remote(args.calls, b, args.context).result()
        results[str(b)] = {k: {"p50_ms": statistics.median(v), "p90_ms": float(np.percentile(v, 90)),
                               "p99_ms": float(np.percentile(v, 99))} for k, v in raw.items()}
        print(b, {k: round(v["p50_ms"], 3) for k, v in results[str(b)].items()})
    serve.delete("hop-bench")
    path = write_json(args.out, "hop", {"calls": args.calls, "context_tokens": args.context, "results": results})

    plt = figure()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    batches = list(results)
    width = 0.8 / len(TRANSPORTS)
    for i, name in enumerate(TRANSPORTS):
        xs = [j + (i - (len(TRANSPORTS) - 1) / 2) * width for j in range(len(batches))]
        p50 = [results[b][name]["p50_ms"] for b in batches]
        p90 = [results[b][name]["p90_ms"] for b in batches]
        ax.bar(xs, p50, width, label=name, yerr=[[0] * len(p50), [h - m for h, m in zip(p90, p50)]], capsize=3)
    ax.set_xticks(range(len(batches)), [f"{b} seqs, {args.context}-token context" for b in batches])
    ax.set(ylabel="round trip, ms (bar p50, whisker p90)",
           title=f"verifier -> drafter hop, {os.cpu_count()} CPUs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=120)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
