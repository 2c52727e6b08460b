"""Connection-level limits under uvicorn, and the listening socket.

uvicorn's own settings do not cover a client that opens a connection and sends its request line slowly or never
(slowloris): `timeout_keep_alive` only runs between requests and is reset by every byte, and
`limit_concurrency` counts such half-open connections, so a few hundred of them would get every real request a
503. `protocol_class` therefore wraps uvicorn's h11 protocol with:

- a read deadline: a connection must deliver a complete request (line, headers and body) within
  `read_timeout_s` of its start, or of the end of the previous response on a kept-alive connection, else it is
  closed; a request being answered or streamed has no deadline;
- a write stall limit: a response that cannot be sent for `write_timeout_s` because the client stopped reading
  is aborted;
- a connection cap: past `max_connections` open connections, the one that has waited longest without completing
  a request (a half-open or idle kept-alive one) is closed to make room; when every connection is serving a
  request, the new one gets a 503 and is closed.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from powerinfer.errors import InputError
from powerinfer.printable import printable

log = logging.getLogger(__name__)

FD_HEADROOM = 128  # descriptors kept for model files, the listening socket, the event loop, logs ...
_BUSY_BODY = b'{"error": {"message": "too many open connections", "type": "unavailable_error", "param": null, "code": null}}'
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
)


class _GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a read deadline, a write stall limit and a connection cap."""

    read_timeout_s: float = 20.0
    write_timeout_s: float = 60.0
    max_connections: int = 512
    last_refusal_log: float = float("-inf")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self.waiting_since: float | None = None  # when the wait for a request began; None: serving

    # ------------------------------------------------------------------ read deadline
    def _await_request(self) -> None:
        self._cancel_read()
        self.waiting_since = self.loop.time()
        self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _cancel_read(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        self.waiting_since = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if not self.transport.is_closing():
            log.debug("closing a connection that sent no complete request in %.0f s", self.read_timeout_s)
            self.transport.close()

    def _check_request_complete(self) -> None:
        if self.waiting_since is not None and self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self._cancel_read()

    # ------------------------------------------------------------------ uvicorn's protocol hooks
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_request()
        if len(self.connections) > self.max_connections:
            self._make_room()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._check_request_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
            self._await_request()  # the next request on this kept-alive connection (or the rest of this body)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read()
        self._cancel_write()
        super().connection_lost(exc)

    # ------------------------------------------------------------------ write stall
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.write_timeout_s, self._write_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_write()

    def _cancel_write(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_timed_out(self) -> None:
        self._write_timer = None
        log.debug("aborting a response the client has not read for %.0f s", self.write_timeout_s)
        self.transport.abort()

    # ------------------------------------------------------------------ connection cap
    def _make_room(self) -> None:
        open_ = [c for c in self.connections if not c.transport.is_closing()]
        if len(open_) <= self.max_connections:
            return  # the excess is connections already closing
        waiting = [
            c for c in open_ if c is not self and isinstance(c, _GuardedH11) and c.waiting_since is not None
        ]
        if waiting:
            oldest = min(waiting, key=lambda c: c.waiting_since or 0.0)
            log.debug("connection limit %d reached: closing the oldest idle connection", self.max_connections)
            oldest.transport.close()
        else:
            now = self.loop.time()
            if now - self.last_refusal_log >= 10.0:  # one line per 10 s under a flood (per server)
                type(self).last_refusal_log = now
                log.warning("connection limit %d reached: refusing connections (503)", self.max_connections)
            self._cancel_read()
            self.transport.write(_BUSY)
            self.transport.close()


def protocol_class(
    read_timeout_s: float, write_timeout_s: float, max_connections: int
) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with the read deadline, write stall limit and connection cap above."""
    attrs = {
        "read_timeout_s": read_timeout_s,
        "write_timeout_s": write_timeout_s,
        "max_connections": max_connections,
    }
    return type("GuardedH11Protocol", (_GuardedH11,), attrs)


def fit_connections(max_connections: int) -> int:
    """Raise the soft RLIMIT_NOFILE so that `max_connections` sockets fit (plus headroom); the cap that fits
    when the hard limit is lower."""
    try:
        import resource
    except ImportError:  # not POSIX
        return max_connections
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + FD_HEADROOM
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < need:
        cap = max(1, soft - FD_HEADROOM)
        log.warning(
            "open-file limit %d fits %d connections, not --max-connections %d; serving at most %d",
            soft,
            cap,
            max_connections,
            cap,
        )
        return cap
    return max_connections


def bind_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket on (host, port); InputError with one readable line when that is impossible
    (port out of range, unknown host, address in use, permission denied)."""
    if not 0 <= port <= 65535:
        raise InputError(f"--port must be in 0..65535 (0: any free port), got {port}")
    where = f"{printable(host, 100)}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise InputError(f"cannot listen on {where}: {printable(reason)}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        # as asyncio does: a restarted server may bind while old connections linger in TIME_WAIT
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise InputError(f"cannot listen on {where}: {e.strerror or e}") from None
    return sock
