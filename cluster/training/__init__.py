"""Training scripts for the demo target/drafter model pair."""
