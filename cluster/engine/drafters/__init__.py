"""Drafters: one base module (request/output types, the Drafter protocol), one module per
drafter, and the registry every other layer reads (`DRAFTERS`)."""

from cluster.engine.drafters.registry import DRAFTERS, DrafterInfo, drafter_names

__all__ = ["DRAFTERS", "DrafterInfo", "drafter_names"]
