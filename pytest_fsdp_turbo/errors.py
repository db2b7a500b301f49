"""Errors that reach the user as one line, never as a traceback."""

from typing import NoReturn


class ConfigError(ValueError):
    """Bad user input: the message names the option, variable, file or field and what was expected."""


class Unavailable(Exception):
    """The case cannot run here (what was looked for is in the message): a skip, or a failure
    under --fsdp-turbo-strict."""


class LeaseTimeout(TimeoutError):
    """Devices or ports stayed held by other live owners for longer than the lease timeout."""


class CheckoutUnavailable(RuntimeError):
    """The FSDPTurbo checkout could not be provided; the message names the source and git's error."""


def fail_line(message: str) -> NoReturn:
    """Fail the test with exactly one line: never chained to the exception being handled, which
    pytest would otherwise print again under "During handling of the above exception"."""
    import pytest

    raise pytest.fail.Exception(message, pytrace=False) from None


def skip_or_fail(strict: bool, message: str) -> NoReturn:
    """Skip a test that cannot run here, or fail it under --fsdp-turbo-strict; one line."""
    import pytest

    if strict:
        raise pytest.fail.Exception(f"--fsdp-turbo-strict: {message}", pytrace=False) from None
    raise pytest.skip.Exception(message) from None
