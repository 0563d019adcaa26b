"""A context that keeps FakeTensorMode from logging the traceback of a shape probe that fails (the caller reports it)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_fake_tensor_log() -> Iterator[None]:
    """A probe that fails is an answer, not an error: keep FakeTensorMode from logging its traceback."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
