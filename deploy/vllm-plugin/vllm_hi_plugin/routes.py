"""Which route calls which hook: the table the Go side keeps (api/hooks,
written here as routes.json), and a handler per route. Nothing here needs
vLLM or FastAPI, so the table is checked without them."""

from __future__ import annotations

import json
import os

from .wire import HookError

_ROUTES_FILE = os.path.join(os.path.dirname(__file__), "routes.json")

# Hooks whose answer is a stream (SSE) rather than a JSON object.
STREAMING = frozenset({"attach"})


def load() -> list[dict]:
    """The routes: name, method, path (relative to the engine's base URL)."""
    with open(_ROUTES_FILE, encoding="utf-8") as f:
        return json.load(f)


async def read_body(request) -> dict:
    try:
        b = await request.json()
    except Exception:
        raise HookError(400, "The body is not JSON.") from None
    if not isinstance(b, dict):
        raise HookError(400, "The body must be a JSON object.")
    return b


def _plain(method: str):
    async def call(hooks, request):
        return await getattr(hooks, method)()
    return call


def _with_body(method: str):
    async def call(hooks, request):
        return await getattr(hooks, method)(await read_body(request))
    return call


async def _changes(hooks, request):
    try:
        since = int(request.query_params.get("since", "0"))
    except ValueError:
        raise HookError(400, "since must be a cursor (a non-negative integer)", "since") from None
    return await hooks.changes(since)


async def _attach(hooks, request):
    try:
        start = int(request.query_params.get("from", "0"))
    except ValueError:
        raise HookError(400, "from must be an integer", "from") from None
    try:
        wait_ms = int(request.query_params.get("wait_ms", "0"))
    except ValueError:
        raise HookError(400, "wait_ms must be an integer (milliseconds)", "wait_ms") from None
    try:
        text_from = int(request.query_params.get("text_from", "-1"))
    except ValueError:
        raise HookError(400, "text_from must be an integer (code points)", "text_from") from None
    return await hooks.attach(request.path_params["request_id"], start, wait_ms, text_from)


# The handler of each route, by hook name: (hooks, request) → the answer.
HANDLERS = {
    "layout": _plain("layout"),
    "requests": _plain("requests"),
    "changes": _changes,
    "pause": _with_body("pause"),
    "resume": _with_body("resume"),
    "export": _with_body("export"),
    "allocate": _with_body("allocate"),
    "install": _with_body("install"),
    "stage": _with_body("stage"),
    "abort": _with_body("abort"),
    "stats": _plain("stats"),
    "retire": _with_body("retire"),
    "wake": _plain("wake"),
    "attach": _attach,
}


def table() -> list[tuple[dict, object]]:
    """Every route with its handler; a route without a handler, or a
    handler without a route, is an error (the two sides disagree)."""
    routes = load()
    names = [r["name"] for r in routes]
    missing = sorted(set(names) - set(HANDLERS))
    extra = sorted(set(HANDLERS) - set(names))
    if missing or extra:
        raise RuntimeError(f"vllm-hi: routes.json and the plugin's handlers disagree: "
                           f"no handler for {missing}, no route for {extra}")
    return [(r, HANDLERS[r["name"]]) for r in routes]
