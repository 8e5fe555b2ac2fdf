"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}`` with the matching status."""

from __future__ import annotations

import logging
from itertools import takewhile
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("turbospec.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def json_error(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
               headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def param_of(message: str, fields: set[str]) -> str | None:
    """The request field a validation message is about: SamplingParams' messages start with its name."""
    first = message.split(" ", 1)[0]
    return first if first in fields else None


# --- exception handlers ------------------------------------------------------------------------------------

async def api_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    headers = {"Retry-After": "1"} if exc.status == 503 else None
    return json_error(exc.status, exc.message, exc.type, exc.param, exc.code, headers)


async def validation_error_handler(_: Request, exc: Exception) -> JSONResponse:
    """Pydantic's errors, said in one sentence that names the field and what is allowed."""
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    if not errors:
        return json_error(400, "invalid request", "invalid_request_error")
    first = errors[0]
    # a union reports one error per member (its loc names the member): keep the path they all share
    locs = [[str(part) for part in e.get("loc", ()) if part != "body"] for e in errors]
    shared = locs[0]
    for other in locs[1:]:
        shared = list(takewhile(lambda pair: pair[0] == pair[1], zip(shared, other)))
        shared = [a for a, _ in shared]
    param = ".".join(shared) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
        param = None
    elif kind == "extra_forbidden":
        message = f"unknown or unsupported field {param!r}: this server refuses fields it would otherwise ignore"
    elif kind == "missing":
        message = f"{param} is required"
    elif not shared and kind in ("model_attributes_type", "model_type", "dict_type"):
        message = "the request body must be a JSON object"
    elif len(errors) > 1 and param in _UNION_HINTS:
        message = f"{param} {_UNION_HINTS[param]}"
    else:
        message = f"{'.'.join(locs[0]) or 'body'}: {first.get('msg')}"
    return json_error(400, message, "invalid_request_error", param)


_UNION_HINTS = {
    "prompt": "must be a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "must be a string, a list of strings, or null",
}


async def http_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return json_error(exc.status_code, str(exc.detail), kind)


async def internal_error_handler(_: Request, exc: Exception) -> JSONResponse:
    """A failure of ours, not the request's: logged here, and the client told no internals."""
    log.error("internal server error", exc_info=exc)
    return json_error(500, "internal server error: the server failed while handling this request (its log has "
                           "the details)", "internal_server_error")
