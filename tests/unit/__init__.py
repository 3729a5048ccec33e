"""One-process CPU tests, mirroring the package."""
