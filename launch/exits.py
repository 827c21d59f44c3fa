"""How a run that stopped tells its user, for the errors that are theirs to act on: one line and an
exit status, never a traceback. 2: the config or what it names (a bad value, a model that is not
there, engines that refuse this run's keys); 1: the run did not do what it was asked (a drift or
invalid batches stopped it, the earlier run in its output_dir cannot be continued as configured,
another trainer holds it, a checkpoint did not fit). Anything else is a bug and keeps its traceback."""

from __future__ import annotations

import sys


def exit_status(e: BaseException) -> int | None:
    """Print `e` as its user should read it and return the exit status, or None for an unexpected error."""
    from engines.models import ModelUnavailableError
    from launch.checkpoint import CheckpointWriteError, ResumeError
    from launch.config import ConfigError
    from launch.guards import DriftError, InvalidError
    from launch.run_lock import RunLockError
    from rollout.bus.auth import AuthError

    if isinstance(e, ConfigError):
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if isinstance(e, ModelUnavailableError):  # a user error like a bad config value
        print(f"config error: model.path: {e}", file=sys.stderr)
        return 2
    if isinstance(e, AuthError):  # engines refused this run's keys (rollout.engines with another deployment's keys)
        print(f"error: {e}", file=sys.stderr)
        return 2
    if isinstance(e, (DriftError, InvalidError, ResumeError, RunLockError, CheckpointWriteError)):
        print(f"error: {e}", file=sys.stderr)
        return 1
    return None
