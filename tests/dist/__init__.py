"""CPU tests over several gloo processes (tests.dist.harness.run_distributed) and their tiny
transformers checkpoints."""
