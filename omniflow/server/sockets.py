"""What every WebSocket endpoint shares: the API key check at the handshake, the cap on an
endpoint's open sessions, the end of a session's request, the parsing of a client's JSON
messages (bounded in size and nesting), the idle timeout of a session, and one sender task
per socket through which everything the server says leaves in order (so that a reader and
the tasks producing output never write to the socket at once)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from omniflow.server.auth import bearer_matches, token_matches
from omniflow.server.errors import APIError, bad_request, busy
from omniflow.server.protocol import check_unicode

CLOSE_BAD_REQUEST, CLOSE_FAILED, CLOSE_BUSY = 1008, 1011, 1013


def authorised(server, websocket: WebSocket) -> bool:
    """The server's API key, as `Authorization: Bearer KEY` or (browsers cannot set headers
    on a WebSocket) `?api_key=KEY`; true when the server has none."""
    key = server.config.api_key
    if not key:
        return True
    header = websocket.headers.get("authorization", "")
    if header.partition(" ")[0].lower() == "bearer":
        return bearer_matches(header, key)
    return token_matches(websocket.query_params.get("api_key", ""), key)


async def refused(server, websocket: WebSocket) -> bool:
    """Close the handshake of a socket the server does not take (a missing or wrong API key,
    or a server shutting down); whether it did."""
    if not authorised(server, websocket):
        await websocket.close(code=CLOSE_BAD_REQUEST, reason="missing or wrong API key")
        return True
    if server.draining:
        await websocket.close(code=CLOSE_BUSY, reason="the server is shutting down")
        return True
    return False


def open_session(server, path: str, limit: int, flag: str) -> APIError | None:
    """Count a new session of the endpoint `path`; the 503 it gets instead when `limit` are
    open already (`flag` sets the limit). `close_session` uncounts it."""
    if server.sessions[path] >= limit:
        return busy(
            f"this server holds at most {limit} {path} sessions at once ({flag}); retry later"
        )
    server.sessions[path] += 1
    return None


def close_session(server, path: str) -> None:
    server.sessions[path] -= 1


async def end_run(server, path: str, served, run, slot, status: int, began: float) -> None:
    """A session's request done, however it ended: its run (if it started) closed, its
    admission slot (if it got one) freed, and the server told (`finish`: metrics, log)."""
    if run is not None:
        await run.close()
    if slot is not None:
        slot.release()
    server.finish(run, served.name, path, status, began)


class IdleReceiver:
    """A session's client messages (ASGI `websocket.receive` dicts), or None once it has been
    idle for `idle_s`: no client message, and nothing of it running (`busy()`), since the
    last message or `touch()`."""

    def __init__(self, websocket: WebSocket, idle_s: float, busy: Callable[[], bool]):
        self.ws, self.idle_s, self.busy = websocket, idle_s, busy
        self.active = time.monotonic()

    def touch(self) -> None:
        """Something the session ran has ended: its idle time counts from now."""
        self.active = time.monotonic()

    async def receive(self) -> dict | None:
        receiving = asyncio.ensure_future(self.ws.receive())
        try:
            while True:
                quiet = time.monotonic() - self.active
                wait = self.idle_s if self.busy() else self.idle_s - quiet
                if wait <= 0:
                    return None
                done, _ = await asyncio.wait({receiving}, timeout=wait)
                if done:
                    self.active = time.monotonic()
                    return receiving.result()
        finally:
            receiving.cancel()


def client_message(message: dict, max_chars: int, what: str = "message") -> dict:
    """A client's frame (an ASGI `websocket.receive`) as a JSON object with a string `type`,
    or a 400 naming `type` that says why not: a binary frame, more than `max_chars`, not
    JSON, nested deeper than the parser goes, or not such an object."""
    text = message.get("text")
    one = f"{'an' if what[0] in 'aeiou' else 'a'} {what}"
    if text is None:
        raise bad_request(f"{one} is a JSON text frame", param="type")
    if len(text) > max_chars:
        raise bad_request(
            f"{one} is at most {max_chars} characters, not {len(text)}",
            param="type",
            code="too_large",
        )
    try:
        body = json.loads(text)
    except RecursionError:  # nested past what Python's parser recurses through
        raise bad_request(f"{one} is JSON nested too deeply", param="type") from None
    except ValueError as err:
        raise bad_request(f"{one} is not valid JSON: {err}", param="type") from None
    if not isinstance(body, dict) or not isinstance(body.get("type"), str):
        raise bad_request(f"each {what} is a JSON object with a 'type'", param="type")
    check_unicode(text, body)
    return body


class Sender:
    """The socket's outgoing side: `json`, `bytes` and `close` queue what to send, one task
    sends it. A client gone away makes sends no-ops (its reader hears of it)."""

    def __init__(self, websocket: WebSocket):
        self.ws = websocket
        self.out: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.ensure_future(self._loop())

    def json(self, message: dict) -> None:
        self.out.put_nowait(("json", message))

    def bytes(self, data: bytes) -> None:
        self.out.put_nowait(("bytes", data))

    def close(self, code: int, reason: str) -> None:
        self.out.put_nowait(("close", (code, reason[:120])))

    async def flush(self) -> None:
        """Wait until everything queued so far has been sent (or dropped)."""
        with contextlib.suppress(asyncio.CancelledError):
            await self.out.join()

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            kind, value = await self.out.get()
            try:
                if self.ws.client_state != WebSocketState.CONNECTED:
                    continue
                if kind == "json":
                    await self.ws.send_text(json.dumps(value))
                elif kind == "bytes":
                    await self.ws.send_bytes(value)
                else:
                    await self.ws.close(code=value[0], reason=value[1])
            except (RuntimeError, OSError, WebSocketDisconnect):
                pass  # the client went away; the reader hears of it
            finally:
                self.out.task_done()
