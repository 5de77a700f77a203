"""The FastAPI routes of the hooks, one per entry of routes.json."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from . import routes
from .wire import HookError


def _error(e: HookError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _unauthorized() -> JSONResponse:
    return JSONResponse({"error": {"message": "this route needs the agent's credential (Authorization: Bearer …)",
                                   "type": "AuthenticationError", "param": None, "code": 401}},
                        status_code=401, headers={"WWW-Authenticate": 'Bearer realm="vllm-hi"'})


def build_router(get_hooks) -> APIRouter:
    """The routes; get_hooks(request) is the Hooks object, or None while
    the hooks are off."""
    r = APIRouter()

    def add(route: dict, fn) -> None:
        streaming = route["name"] in routes.STREAMING

        async def handler(request: Request):
            h = get_hooks(request)
            if h is None:
                return _error(HookError(404, "vllm-hi hooks are off: start vllm serve with --vllm-hi-type"))
            if not h.authorized(request.headers.get("authorization")):
                return _unauthorized()
            try:
                out = await fn(h, request)
            except HookError as e:
                return _error(e)
            except (KeyError, TypeError, ValueError) as e:
                return _error(HookError(400, f"Malformed request: {e!r}"))
            if streaming:
                return StreamingResponse(out, media_type="text/event-stream")
            return JSONResponse(out)

        r.add_api_route(route["path"], handler, methods=[route["method"]], include_in_schema=False)

    for route, fn in routes.table():
        add(route, fn)
    return r
