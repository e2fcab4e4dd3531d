"""Ray Serve deployments around the engine: Router (gRPC ingress), Verifier, Drafter."""
