"""Errors a user can fix. The command-line entry points print them as one line and exit 2."""


class OptimusError(Exception):
    """A problem with the user's input (config, flags, files), not a bug."""


class ConfigError(OptimusError):
    """A config field is missing, mistyped or inconsistent.

    The message always names the field (dotted path) and what would be valid.
    """

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


class AgreedError(OptimusError):
    """An OptimusError every rank raises with the same message, after agreeing on it (rank 0 reports
    it)."""
