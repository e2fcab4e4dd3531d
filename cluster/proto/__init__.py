"""Generated gRPC code for protos/speccluster/v1/ (generation.proto: the public API; drafting.proto: the verifier -> drafter hop).

Import the modules directly: `from cluster.proto import generation_pb2 as pb`.
Only gen.py is written by hand; regenerate the rest with `python -m cluster.proto.gen`.
"""
