"""Speculation within a step: one propose call per drafter (drafting), which drafts stand
(acceptance), and the aux hidden states EAGLE-3 reads (aux_hidden)."""
