"""Training backends (actor, reference) and the RL loss; one module per backend, no orchestration."""
