"""Errors that reach the user as one line, never as a traceback."""


class ConfigError(ValueError):
    """Bad user input: the message names the option, variable, file or field and what was expected."""


class LeaseTimeout(TimeoutError):
    """Devices or ports stayed held by other live owners for longer than the lease timeout."""


class CheckoutUnavailable(RuntimeError):
    """The FSDPTurbo checkout could not be provided; the message names the source and git's error."""
