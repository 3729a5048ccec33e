"""Slurm tests on a local one-node cluster (skipped without its binaries)."""
