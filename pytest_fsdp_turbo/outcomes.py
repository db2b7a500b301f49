"""A test's outcome said in one line: failed, or skipped (failed under --fsdp-turbo-strict)."""

from typing import NoReturn

import pytest


def fail_line(message: str) -> NoReturn:
    """Fail the test with exactly one line: never chained to the exception being handled, which
    pytest would otherwise print again under "During handling of the above exception"."""
    raise pytest.fail.Exception(message, pytrace=False) from None


def skip_or_fail(strict: bool, message: str) -> NoReturn:
    """Skip a test that cannot run here, or fail it under --fsdp-turbo-strict; one line."""
    if strict:
        raise pytest.fail.Exception(f"--fsdp-turbo-strict: {message}", pytrace=False) from None
    raise pytest.skip.Exception(message) from None
