"""Python callables named in the config as `package.module:function`."""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Callable
from typing import Any


def load_callable(ref: str) -> Callable[..., Any]:
    """`package.module:function` -> the function; raises ValueError with the reason."""
    module_name, _, attr = ref.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r}: {exc}") from None
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ValueError(f"{module_name!r} has no attribute {attr!r}")
    if not callable(target):
        raise ValueError(f"{ref!r} is not callable")
    return target  # type: ignore[no-any-return]


async def call(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Awaits an async callable; runs a sync one in a worker thread, off the event loop."""
    if inspect.iscoroutinefunction(func):
        return await func(*args, **kwargs)
    return await asyncio.to_thread(func, *args, **kwargs)
