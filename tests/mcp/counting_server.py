"""An MCP server for onceflow's tests, built with the official Python SDK.

It counts what it received: every `tools/call` request, with its tool, the
idempotency key onceflow put in `params._meta` and its Authorization
header, is recorded before the tool runs, and `GET /calls` answers them
all. Tools:

* `lookup` (readOnlyHint): reads an order's status;
* `refund` (no hints: a side effect, not idempotent): pays money back;
* `cancel_order` (idempotentHint, destructiveHint): cancels an order;
* `annotate` (destructiveHint false): adds a note to an order;
* `broken` (readOnlyHint): always answers `isError: true`;
* `void_invoice` (no hints): takes itself off the server's list, then
  answers `isError: true` (it failed partway, and was withdrawn).

* `big` (readOnlyHint): answers `size` bytes.

`lookup` and `refund` take `hold_ms`: the tool sleeps that long before it
answers (a test kills the engine meanwhile), and `hold_first_ms`: only the
first call for an order does. Usage: counting_server.py PORT
"""

import asyncio
import json
import sys

import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp_types import ToolAnnotations

KEY = "io.onceflow/idempotency-key"
calls = []

server = MCPServer("counting")


def first(tool: str, order_id: str) -> bool:
    """Whether this is the first call of `tool` for `order_id`."""
    return sum(1 for c in calls if c["tool"] == tool and (c["arguments"] or {}).get("order_id") == order_id) <= 1


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
async def lookup(order_id: str, hold_ms: int = 0, hold_first_ms: int = 0) -> str:
    """The status of an order."""
    await asyncio.sleep((hold_ms + (hold_first_ms if first("lookup", order_id) else 0)) / 1000)
    return f"order {order_id} is shipped"


@server.tool(annotations=ToolAnnotations(readOnlyHint=False))
async def refund(order_id: str, amount: int, hold_ms: int = 0, hold_first_ms: int = 0) -> str:
    """Refunds an order (money leaves the shop)."""
    await asyncio.sleep((hold_ms + (hold_first_ms if first("refund", order_id) else 0)) / 1000)
    return f"refunded {amount} on order {order_id}"


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
async def big(size: int) -> str:
    """An answer of `size` bytes."""
    return "x" * size


@server.tool(annotations=ToolAnnotations(idempotentHint=True, destructiveHint=True))
async def cancel_order(order_id: str, hold_ms: int = 0) -> str:
    """Cancels an order (cancelling it twice is cancelling it once)."""
    await asyncio.sleep(hold_ms / 1000)
    return f"order {order_id} is cancelled"


@server.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False))
async def annotate(order_id: str, note: str) -> str:
    """Adds a note to an order (a change, never a destructive one)."""
    return f"noted on order {order_id}: {note}"


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
async def broken(order_id: str) -> str:
    """Always fails."""
    raise ValueError(f"no such order: {order_id}")


@server.tool(annotations=ToolAnnotations(readOnlyHint=False))
async def void_invoice(invoice_id: str) -> str:
    """Voids an invoice; fails partway and is withdrawn from the server."""
    server.remove_tool("void_invoice")
    raise ValueError(f"voiding {invoice_id} failed halfway")


mcp_app = server.streamable_http_app()


async def app(scope, receive, send):
    """Counts `tools/call` requests, answers `GET /calls`, passes the rest."""
    if scope["type"] == "http" and scope["path"] == "/calls":
        body = json.dumps(calls).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
        return
    if scope["type"] != "http" or scope["method"] != "POST":
        await mcp_app(scope, receive, send)
        return
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    raw = b"".join(chunks)
    try:
        messages = json.loads(raw)
    except ValueError:
        messages = []
    headers = dict(scope.get("headers") or [])
    auth = headers.get(b"authorization", b"").decode() or None
    for m in messages if isinstance(messages, list) else [messages]:
        if isinstance(m, dict) and m.get("method") == "tools/call":
            params = m.get("params") or {}
            calls.append({
                "tool": params.get("name"),
                "key": (params.get("_meta") or {}).get(KEY),
                "arguments": params.get("arguments"),
                "authorization": auth,
            })
    sent = False

    async def replay():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    await mcp_app(scope, replay, send)


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
                lifespan="on")
