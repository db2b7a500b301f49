"""Errors that reach the user as one line, never as a traceback."""


class ConfigError(ValueError):
    """Bad user input: the message names the option, variable, file or field and what was expected."""


class Unavailable(Exception):
    """The case cannot run here (what was looked for is in the message): a skip, or a failure
    under --fsdp-turbo-strict."""


class LeaseTimeout(TimeoutError):
    """Devices or ports stayed held by other live owners for longer than the lease timeout."""


class CheckoutUnavailable(RuntimeError):
    """The FSDPTurbo checkout could not be provided; the message names the source and git's error."""


# the tiny-model builder's exit code for a spec that is wrong (said on its last stderr line)
SPEC_ERROR_EXIT = 2
