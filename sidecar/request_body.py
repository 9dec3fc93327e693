"""A request body as the sidecar reads one (POST /mode, a group worker's POST /group/mode): after authentication
(the route's dependency), JSON only (415), at most `limit` bytes whether declared or chunked (413), parsed into a
typed model (422 naming each field, never echoing the input, nor an unknown field's name); a client gone mid-body is a 400, not a traceback.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from fastapi import HTTPException, Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

M = TypeVar("M", bound=BaseModel)


def validation_detail(errors: list[dict], fields: Iterable[str] = ()) -> list[dict]:
    """A 422's detail: where and what, without the input itself (it may be large, or meant for a log). A field the
    body should not have is the client's text too: it is said to be unknown, with the `fields` the body takes."""
    detail = []
    for e in errors:
        loc, msg = list(e["loc"]), e["msg"]
        if e["type"] == "extra_forbidden":
            loc, msg = (
                loc[:-1],
                "an unknown field (its name is not echoed); the fields are: " + ", ".join(fields),
            )
        detail.append({"loc": loc, "msg": msg, "type": e["type"]})
    return detail


async def json_body(request: Request, model: type[M], limit: int, what: str) -> M:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise HTTPException(415, f"{what} takes JSON: send 'Content-Type: application/json'")
    too_large = HTTPException(413, f"the body is larger than {limit} bytes; {what} takes a few fields")
    try:
        declared = int(request.headers.get("content-length", "0"))
    except ValueError:
        raise HTTPException(400, "Content-Length is not a number") from None
    if declared > limit:
        raise too_large
    raw = bytearray()
    try:
        async for chunk in request.stream():  # a chunked body has no Content-Length: count as it arrives
            raw += chunk
            if len(raw) > limit:
                raise too_large
    except ClientDisconnect:
        raise HTTPException(400, "the client closed the connection before its body ended") from None
    try:
        return model.model_validate_json(bytes(raw))
    except ValidationError as e:
        raise HTTPException(422, validation_detail(e.errors(), model.model_fields)) from None
