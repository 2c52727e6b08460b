"""Errors in the OpenAI shape, used by every endpoint: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

from powerinfer.printable import printable

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
    504: "timeout_error",
}


class ApiError(Exception):
    """An error answer: HTTP status plus the OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        """The error as one server-sent event (errors after a stream has started)."""
        return f"data: {json.dumps(self.body())}\n\n"


def validation_message(errors: list[Any]) -> tuple[str, str | None]:
    """A readable message and the offending parameter from pydantic/FastAPI validation errors."""
    parts = []
    param = None
    for e in errors[:5]:
        loc = [printable(str(x), 60) for x in e.get("loc", ()) if x != "body"]  # keys may be the client's
        where = ".".join(loc)
        if e.get("type") == "json_invalid":
            parts.append(f"malformed JSON body: {printable(e.get('ctx', {}).get('error', e.get('msg')))}")
        elif e.get("type") == "missing":
            parts.append(f"missing field '{where}'")
        else:
            parts.append(f"{where or 'body'}: {printable(e.get('msg'))}")
        if param is None and loc and e.get("type") != "json_invalid":
            param = loc[0]  # the top-level field
    if len(errors) > 5:
        parts.append(f"... and {len(errors) - 5} more")
    return "; ".join(parts) or "invalid request", param
