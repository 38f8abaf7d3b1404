"""nixl_keepalive: the keepalive service for Python decode runtimes.

A decode engine pulls KV cache from prefill engines with NIXL READs. When a
prefill dies or restarts, the decoder's NIXL agent keeps the dead peer's
remote metadata, UCX endpoints and remote keys (on multi-node NVLink, a
mapping of the dead prefill's GPU memory). This package runs the Rust
keepalive service over *your* ``nixl_agent``: it heartbeats every known
prefill engine (vLLM's ``HB:`` lease renewal), tells REMOTE_DISCONNECT apart
from every other error, and releases a dead, replaced or retired engine
(``release_dlist_handle``, ``remove_remote_agent``) as soon as no read from
it is in flight, and never before.

Embedding it (see the README's "Python" section for the vLLM hooks)::

    ka = Keepalive(agent)                         # NIXL_KEEPALIVE_* knobs, or keywords
    with ka.handshake(addr) as h:                 # before the side channel
        reply = side_channel(addr)
        engine = h.ready_to_load(reply.engine_id, agents, incarnation=reply.incarnation)
        if engine is None:                        # load now
            names = [agent.add_remote_agent(md) for md in reply.metadata]
            handles = [agent.prep_xfer_dlist(n, blocks, "DRAM") for n in names]
            engine = h.register(handles)
    with engine.read() as r:                      # ReadRefused at once on a marked engine
        ...transfer, poll...
        r.finish(xfer_status(agent, handle))      # REMOTE_DISCONNECT marks the engine
    ka.close()                                    # drains reads, releases everything

The service runs on a thread of its own (a tokio runtime of this package);
Python waits for it with the GIL released, and it takes the GIL only for
the length of one call on the agent.

Import this package before the process makes its first ``nixl_agent``:
NIXL 1.5.1's ``remove_remote_agent`` leaves a live prefill's UCX endpoint
and TCP connection open until the agent dies, and the package makes its
releases close them by installing, at import, a shim that NIXL's UCX plugin
binds to when it is loaded (by the first agent's UCX backend). Imported
later, :func:`endpoint_close_mode` says ``unavailable`` and why, and
:class:`Keepalive` warns.
"""

from __future__ import annotations

import atexit
import warnings
import weakref
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

from . import _native
from ._native import (
    NOT_FOUND,
    REMOTE_DISCONNECT,
    SUCCESS,
    Config,
    ConfigError,
    Engine,
    Events,
    Handshake,
    IdentityConflict,
    KeepaliveError,
    Read,
    ReadRefused,
    RegistrationRefused,
    ServiceStopped,
    classify_exception,
    endpoint_close_mode,
    knobs,
    remove_remote_agent,
    status_name,
    xfer_status,
)

__all__ = [
    "AsyncHandshake",
    "Config",
    "ConfigError",
    "Engine",
    "Events",
    "Handshake",
    "HandshakeScope",
    "IdentityConflict",
    "Keepalive",
    "KeepaliveError",
    "NOT_FOUND",
    "REMOTE_DISCONNECT",
    "Read",
    "ReadRefused",
    "RegistrationRefused",
    "SUCCESS",
    "ServiceStopped",
    "classify_exception",
    "endpoint_close_mode",
    "knobs",
    "remove_remote_agent",
    "status_name",
    "xfer_status",
]

__version__ = _native.__version__

EngineLike = Union[str, Engine]


class AsyncHandshake:
    """The handshake protocol with awaitables: what ``async with
    ka.handshake(addr) as h`` gives. Same steps as :class:`Handshake`."""

    __slots__ = ("_h",)

    def __init__(self, handshake: Handshake) -> None:
        self._h = handshake

    @property
    def address(self) -> str:
        """The address this handshake is with."""
        return self._h.address

    @property
    def ended(self) -> bool:
        """Whether the handshake has ended."""
        return self._h.ended

    async def ready_to_load(
        self, engine_id: str, agents: Sequence[Union[str, bytes]], incarnation: Optional[int] = None
    ) -> Optional[Engine]:
        """See :meth:`Handshake.ready_to_load`. Cancelling it ends the
        handshake."""
        return await self._h.ready_to_load_async(engine_id, list(agents), incarnation)

    async def register(self, dlist_handles: Sequence[Any]) -> Engine:
        """See :meth:`Handshake.register`."""
        return await self._h.register_async(list(dlist_handles))

    def claim_agent(self, agent: Union[str, bytes]) -> None:
        """See :meth:`Handshake.claim_agent` (it blocks briefly, GIL
        released)."""
        self._h.claim_agent(agent)

    def finish(self) -> None:
        """Ends the handshake (leaving the ``async with`` block does)."""
        self._h.finish()


class HandshakeScope:
    """A handshake about to start with one address. Use it as a context
    manager: ``with`` gives a :class:`Handshake` (blocking calls, GIL
    released while they wait), ``async with`` an :class:`AsyncHandshake`.
    The handshake starts on entering (hold the block around the side
    channel: a marked engine at the address is not released while it is
    open) and ends on leaving, registered or not."""

    __slots__ = ("_service", "_address", "_h")

    def __init__(self, service: _native.Service, address: str) -> None:
        self._service = service
        self._address = address
        self._h: Optional[Handshake] = None

    def __enter__(self) -> Handshake:
        self._h = self._service.handshake(self._address)
        return self._h

    def __exit__(self, *exc: object) -> None:
        if self._h is not None:
            self._h.finish()

    async def __aenter__(self) -> AsyncHandshake:
        self._h = self._service.handshake(self._address)
        return AsyncHandshake(self._h)

    async def __aexit__(self, *exc: object) -> None:
        if self._h is not None:
            self._h.finish()


_live: "weakref.WeakSet[Keepalive]" = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    # The service's releases call the agent, which needs the interpreter:
    # stop them while it is still whole.
    for ka in list(_live):
        try:
            ka.close()
        except Exception:  # pragma: no cover - best effort at exit
            pass


class Keepalive:
    """The keepalive service over the caller's ``nixl_agent``.

    Args:
        agent: the decoder's ``nixl_agent`` (NIXL's Python API). The service
            calls ``send_notif``, ``release_dlist_handle`` and
            ``remove_remote_agent`` on it from its own threads, so make it
            with a locking thread-sync mode:
            ``nixl_agent_config(sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)``.
        config: a :class:`Config`; without one, ``**knobs`` (keyword
            arguments of :class:`Config`) over the ``NIXL_KEEPALIVE_*``
            environment variables. A refused value raises
            :class:`ConfigError` naming it, its value, why, and what is
            accepted.

    Use it as a context manager (``with Keepalive(agent) as ka``), or call
    :meth:`close`.
    """

    def __init__(self, agent: Any, config: Optional[Config] = None, **knobs: Any) -> None:
        if config is not None and knobs:
            raise TypeError("pass either a Config or keyword arguments, not both")
        if config is None:
            config = Config(**knobs)
        self._config = config
        self._service = _native.Service(agent, config)
        closing = endpoint_close_mode()
        if closing["mode"] == "unavailable":
            warnings.warn(
                "nixl_keepalive: releases cannot close a live prefill's UCX endpoints in this process "
                f"(one TCP connection per rank stays open per release): {closing['reason']}",
                RuntimeWarning,
                stacklevel=2,
            )
        self._closed: Optional[dict] = None
        _live.add(self)

    # -- connecting -------------------------------------------------------

    def handshake(self, address: str) -> HandshakeScope:
        """The handshake protocol with the prefill at ``address``
        (``host:port``): connect, reconnect, or reload a pinned engine id.
        ``with ka.handshake(addr) as h`` / ``async with``; see
        :class:`Handshake`."""
        return HandshakeScope(self._service, address)

    def register(
        self,
        engine_id: str,
        address: str,
        agents: Sequence[Union[str, bytes]],
        dlist_handles: Sequence[Any],
        incarnation: Optional[int] = None,
    ) -> Engine:
        """Registers an engine already loaded, without a handshake: any
        older registration of the id is released first, but only after
        this one's metadata was loaded. Prefer :meth:`handshake` for engine
        ids that may come back."""
        names = [a.decode() if isinstance(a, bytes) else a for a in agents]
        return self._service.register(engine_id, address, names, list(dlist_handles), incarnation)

    def engine(self, engine_id: str) -> Optional[Engine]:
        """The registered engine ``engine_id``, if any."""
        return self._service.engine(engine_id)

    # -- leases and the router -------------------------------------------

    def add_leases(self, engine: EngineLike, requests: Iterable[str], renew_now: bool = False) -> None:
        """Renews these request ids (vLLM's lease heartbeat, ``HB:id,...``)
        with every heartbeat to ``engine`` until removed."""
        self._service.add_leases(engine, list(requests), renew_now)

    def remove_leases(self, engine: EngineLike, requests: Iterable[str]) -> None:
        """Stops renewing these request ids (on request completion)."""
        self._service.remove_leases(engine, list(requests))

    def renew_leases(self, engine: EngineLike) -> None:
        """A lease renewal to ``engine`` as soon as its rate cap allows."""
        self._service.renew_leases(engine)

    def peer_gone(
        self, engine: Optional[EngineLike] = None, *, address: Optional[str] = None, mode: str = "drain"
    ) -> None:
        """The router says a prefill is gone, by engine id or by
        ``address=`` (exactly one). ``mode="drain"`` lets its reads in
        flight finish, ``"fail"`` fails them at once; it is released when
        they have ended. Idempotent; a no-op for unknown peers."""
        self._service.peer_gone(engine, address=address, mode=mode)

    # -- looking at it ------------------------------------------------------

    def snapshot(self) -> dict:
        """The service's table as plain dicts: per engine its state, reads
        in flight, leases, last heartbeat and, in words, why it is kept or
        what its release waits for; and ``endpoints``: the close mode
        (:func:`endpoint_close_mode`), what the releases did to UCX
        endpoints so far (``closed``, ``left_open``, ``none_closed``,
        ``not_observed``), and UCX's own count of the endpoints the agent
        holds now (``ucx_endpoints``: NIXL's loopback endpoint plus one per
        connected remote agent; ``None`` without UCX's VFS)."""
        return self._service.snapshot()

    async def snapshot_async(self) -> dict:
        """:meth:`snapshot` as an awaitable."""
        return await self._service.snapshot_async()

    def events(self) -> Events:
        """The service's events from now on (iterator, async iterator, or
        :meth:`Events.get`)."""
        return self._service.events()

    def transport_stats(self) -> dict:
        """How long the service's calls on the agent waited for the GIL."""
        return self._service.transport_stats()

    def xfer_status(self, handle: Any) -> int:
        """The raw status of transfer ``handle`` on this keepalive's agent
        (see :func:`xfer_status`)."""
        return xfer_status(self._service.agent, handle)

    @property
    def agent(self) -> Any:
        """The agent the service calls."""
        return self._service.agent

    @property
    def config(self) -> Config:
        """The configuration in force."""
        return self._config

    @property
    def closed(self) -> bool:
        """Whether the service has stopped."""
        return self._service.stopped

    # -- stopping -----------------------------------------------------------

    def close(self) -> dict:
        """Stops the service as the Rust shutdown does (marks every engine,
        releases each as its reads end, for at most the shutdown drain) and
        waits for it. Returns ``{"unreleased": [...], "releases_unfinished":
        [...]}``: registrations still held (give each back with
        :meth:`give_back` once its reads have ended) and engines whose
        release call had not come back. Idempotent."""
        if self._closed is None:
            self._closed = self._service.close()
        return self._closed

    async def aclose(self) -> dict:
        """:meth:`close` as an awaitable."""
        if self._closed is None:
            self._closed = await self._service.close_async()
        return self._closed

    def give_back(self, registration: Mapping[str, Any]) -> list:
        """Gives back a registration the service handed back
        (``RegistrationRefused.registration``, ``close()["unreleased"]``)
        through the agent, as the service would: each dlist handle, then
        each agent's remote metadata. Returns each step with its raw
        status."""
        if not isinstance(registration, dict):
            registration = dict(registration)
        return self._service.give_back(registration)

    def __enter__(self) -> "Keepalive":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> "Keepalive":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"Keepalive(agent={getattr(self.agent, 'name', self.agent)!r}, {self._config!r})"
