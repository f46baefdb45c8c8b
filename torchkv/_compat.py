"""The one place that touches torch internals."""

import contextlib
from collections.abc import Iterator

import torch

#: graphs one compiled torchkv function may hold (pipelines x batch sizes x dtypes x masks); the default
#: of 8 would silently send later pipelines to slow eager code.
RECOMPILE_LIMIT = 64


@contextlib.contextmanager
def recompile_headroom() -> Iterator[None]:
    """Raise dynamo's per-function recompile limit for the duration of a torchkv compiled call only."""
    config = torch._dynamo.config
    previous = config.recompile_limit
    config.recompile_limit = max(RECOMPILE_LIMIT, previous)
    try:
        yield
    finally:
        config.recompile_limit = previous
