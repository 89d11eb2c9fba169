"""The one base class of errors caused by the user's input rather than by a bug.

The CLI prints these as a single ``error:`` line and exits 2; every other
exception keeps its traceback. Each subclass's message names the field, file,
line or tensor at fault.
"""

# The exit status of a user error, for every command: a job template must not requeue it.
EXIT_USER_ERROR = 2


class UserError(ValueError):
    """Bad config, bad data, a missing or malformed file: the user can fix it."""


class CheckpointError(UserError):
    """A checkpoint or model folder is missing, incomplete, corrupt or inconsistent; names the file."""


class CheckpointWriteError(RuntimeError):
    """Writing a checkpoint failed (a full disk, a broken pipe, a lost filesystem); the previous one is intact.

    Not a ``UserError``: the environment failed, not the input, so the process exits 1 and a
    SLURM job is requeued (within its budget) to resume from the previous checkpoint.
    """


class NonFiniteTrainingError(UserError):
    """Too many consecutive non-finite losses or gradients: the run stops before the policy is damaged."""
