"""Where a failure becomes the error a client sees: OpenAI's error JSON with its status.

Every route answers failures through `error_response`, so that a refusal, an overload, a drain or a
fault of the server look the same wherever they happen. A 5xx carries a generic message; the
log names the exception's type only, never its message (it could quote the request).
"""

from __future__ import annotations

import logging
import re

from fastapi.responses import JSONResponse

from ..errors import ConfigError
from .async_engine import EngineFailed, Overloaded, ShuttingDown
from .protocol import APIError

log = logging.getLogger(__name__)


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def api_error(err: Exception) -> APIError:
    """Map what the engine side raises to the error a client sees."""
    if isinstance(err, APIError):
        return err
    if isinstance(err, Overloaded):
        return APIError(429, "the server is at capacity: too many requests are waiting; retry later",
                        type="rate_limit_error", code="server_overloaded",
                        headers={"Retry-After": str(err.retry_after)})
    if isinstance(err, EngineFailed):
        return APIError(503, str(err), type="server_error", code="engine_failed")
    if isinstance(err, ShuttingDown):
        return APIError(503, str(err), type="server_error", code="shutting_down")
    if isinstance(err, ConfigError):
        m = re.search(r"SamplingParams\.(\w+)", str(err))
        return APIError(400, str(err).replace("SamplingParams.", ""), param=m.group(1) if m else None)
    log.error("request failed: %s", type(err).__name__)  # no message: it could quote the request
    return APIError(500, "internal server error", type="server_error")


async def answer(work):
    """Await `work` (a route's coroutine); any failure becomes its error response."""
    try:
        return await work
    except Exception as err:  # noqa: BLE001 (every failure becomes an error response)
        return error_response(api_error(err))
