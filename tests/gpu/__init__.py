"""CUDA tests (the gpu marker; skipped without a GPU)."""
