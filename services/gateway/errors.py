"""A refused request, in OpenAI's error shape on HTTP and as an error frame on the websocket."""
import math

import orjson
from starlette.responses import Response

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
         415: "invalid_request_error", 429: "rate_limit_error", 431: "invalid_request_error"}
# the websocket protocol's codes; else invalid_request
FRAME_CODES = {403: "forbidden", 404: "not_found", 429: "too_many_requests", 503: "unavailable"}
# pipeline error codes → HTTP
STATUS = {"invalid_request": 400, "context_length_exceeded": 400, "forbidden": 403, "not_found": 404, "resumed": 409,
          "too_many_requests": 429, "unavailable": 503, "timeout": 504}


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 retry_after: float | None = None):
        super().__init__(message)
        self.status, self.code, self.param, self.retry_after = status, code, param, retry_after

    @property
    def message(self) -> str:
        return str(self)

    def body(self) -> dict:
        kind = TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        headers = {} if self.retry_after is None else {"retry-after": str(seconds(self.retry_after))}
        if self.status == 413:                    # the rest of the body is not worth reading
            headers["connection"] = "close"
        return Response(orjson.dumps(self.body()), self.status, headers, media_type="application/json")

    def frame(self, cid: str | None) -> dict:
        """The websocket's error frame; retry_after (seconds, as Retry-After) when a retry will pass."""
        code = self.code if self.code == "context_length_exceeded" else FRAME_CODES.get(self.status, "invalid_request")
        frame = {"type": "error", "id": cid, "code": code, "message": self.message}
        if self.retry_after is not None:
            frame["retry_after"] = seconds(self.retry_after)
        return frame


def seconds(s: float) -> int:
    """Retry-After is whole seconds; rounded up, and at least 1."""
    return max(1, math.ceil(s))


def from_pipeline(code: str, message: str) -> ApiError:
    """An error chunk of the pipeline (the tokenizer's or the worker's) as an HTTP error."""
    return ApiError(STATUS.get(code, 502 if code == "worker_failed" else 500), message, code)
