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
            names = [load_remote_agent(agent, lambda md=md: agent.add_remote_agent(md)) for md in reply.metadata]
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
import difflib
import enum
import importlib
import os
import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Sequence, Union

if TYPE_CHECKING:  # typed dicts of the stubs (_native.pyi): no runtime cost
    from ._native import Event, Snapshot  # noqa: F401

from . import _native
from ._native import (
    BACKEND,
    CANCELED,
    IN_PROG,
    INVALID_PARAM,
    MISMATCH,
    NO_TELEMETRY,
    NOT_ALLOWED,
    NOT_FOUND,
    NOT_POSTED,
    NOT_SUPPORTED,
    REMOTE_DISCONNECT,
    REPOST_ACTIVE,
    SUCCESS,
    UNKNOWN,
    Config,
    ConfigError,
    Engine,
    Events,
    GivenUpRead,
    Handshake,
    IdentityConflict,
    KeepaliveError,
    Read,
    ReadRefused,
    RegistrationRefused,
    ReleaseHeld,
    ServiceStopped,
    canonical_address,
    classify_exception,
    endpoint_close_mode,
    gpu_mappings,
    knobs,
    load_remote_agent,
    parse_ucx_time,
    remove_remote_agent,
    status_name,
    xfer_status,
)

__all__ = [
    "AsyncHandshake",
    "BACKEND",
    "CANCELED",
    "Config",
    "ConfigError",
    "Destination",
    "Engine",
    "Events",
    "GiveUp",
    "GivenUpRead",
    "Handshake",
    "HandshakeScope",
    "IN_PROG",
    "INVALID_PARAM",
    "IdentityConflict",
    "Keepalive",
    "KeepaliveError",
    "MISMATCH",
    "NOT_ALLOWED",
    "NOT_FOUND",
    "NOT_POSTED",
    "NOT_SUPPORTED",
    "NO_TELEMETRY",
    "REMOTE_DISCONNECT",
    "REPOST_ACTIVE",
    "Read",
    "ReadRefused",
    "RegistrationRefused",
    "ReleaseHeld",
    "SUCCESS",
    "ServiceStopped",
    "UNKNOWN",
    "agent_config",
    "canonical_address",
    "classify_exception",
    "endpoint_close_mode",
    "gpu_mappings",
    "knobs",
    "load_remote_agent",
    "make_agent",
    "parse_agent_name",
    "parse_ucx_time",
    "remove_remote_agent",
    "status_name",
    "xfer_status",
]


class GiveUp(str, enum.Enum):
    """Why a read was given up (:meth:`Read.give_up`); equal to its string."""

    #: The runtime's read timeout passed: its own verdict that the engine
    #: is hung (with no other read of it completing meanwhile, the engine
    #: is marked stalled at once).
    TIMED_OUT = "timed_out"
    #: Aborted for the runtime's own reasons (the request was cancelled,
    #: the decoder is stopping): no evidence about the engine.
    CANCELLED = "cancelled"


class Destination(str, enum.Enum):
    """What may become of a given-up read's destination buffer
    (:meth:`GivenUpRead.wait_destination`); equal to its string."""

    #: The release ended every transfer to the engine: the buffer is yours.
    REUSABLE = "reusable"
    #: The release cannot prove the transfer is over (NIXL 1.5.1 always):
    #: never reuse the buffer; keep it allocated while the agent lives.
    RETIRE = "retire"


#: The thread-sync modes that make a ``nixl_agent`` safe to call from the
#: service's threads beside the decoder's own (NIXL's default, NONE, is a
#: data race).
_SAFE_SYNC_MODES = ("NIXL_THREAD_SYNC_RW", "NIXL_THREAD_SYNC_STRICT")

#: The NIXL Python packages, in the order an agent config is made from.
_NIXL_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")

#: Where :func:`make_agent` records the config an agent was made with
#: (``nixl_agent`` keeps no copy of it).
_CONFIG_ATTR = "_nixl_keepalive_agent_config"


def _nixl_api() -> Any:
    """NIXL's ``_api`` module: the first installed of :data:`_NIXL_MODULES`."""
    for name in _NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(
        "no NIXL Python API found: install nixl (or nixl-cu12 / nixl-cu13); tried " + ", ".join(_NIXL_MODULES)
    )


def agent_config(**kwargs: Any) -> Any:
    """A ``nixl_agent_config`` fit for the service: NIXL's own keywords
    (``backends``, ``num_threads``, ...), with ``sync_mode`` RW and the
    progress thread on unless you say otherwise. Pass it to
    ``nixl_agent(name, conf)`` and to ``Keepalive(agent, agent_config=conf)``."""
    api = _nixl_api()
    kwargs.setdefault("sync_mode", api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
    kwargs.setdefault("enable_prog_thread", True)
    return api.nixl_agent_config(**kwargs)


def make_agent(name: str, **kwargs: Any) -> Any:
    """A ``nixl_agent`` made with :func:`agent_config` (same keywords), which
    :class:`Keepalive` then knows to be safe with its threads and
    progressed. Import this package before the first agent is made (see the
    module's docs)."""
    conf = agent_config(**kwargs)
    agent = _nixl_api().nixl_agent(name, conf)
    setattr(agent, _CONFIG_ATTR, conf)
    return agent


def parse_agent_name(metadata: bytes) -> Optional[str]:
    """The agent name in NIXL's serialized agent metadata
    (``get_agent_metadata()``: ``nixlSerDes|Agent`` + 8-byte little-endian
    length + name), or ``None`` when it is not in that form. The service's
    claim needs it before the metadata is loaded, and neither vLLM's
    handshake nor SGLang's registration is bound to it."""
    head = b"nixlSerDes|Agent"
    if not isinstance(metadata, (bytes, bytearray, memoryview)):
        return None
    data = bytes(metadata[: len(head) + 8 + 4096])
    if not data.startswith(head) or len(data) < len(head) + 8:
        return None
    n = int.from_bytes(data[len(head) : len(head) + 8], "little")
    if n <= 0 or n > 4096 or len(data) < len(head) + 8 + n:
        return None
    try:
        return data[len(head) + 8 : len(head) + 8 + n].decode()
    except UnicodeDecodeError:
        return None


def _end_transfer_guard(guard: Any, outcome: Any) -> None:
    """Ends a read or write guard with what ended its transfer: a raw
    status, ``"DONE"`` or NIXL's exception is finished (REMOTE_DISCONNECT
    marks the engine); ``None`` or an exception that is not NIXL's (NIXL
    said nothing) closes it without a status. The connectors' one rule."""
    if outcome is None or (isinstance(outcome, BaseException) and classify_exception(outcome) is None):
        guard.close()
    else:
        guard.finish(outcome)


def _raw_status(agent: Any, handle: Any) -> Any:
    """What a polled transfer's guard ends with: its raw status (an int,
    :func:`xfer_status`), or the exception asking for it raised (the
    agent could not say). For a stand-in that is not NIXL's agent (vLLM's
    unit tests' fake), its ``check_xfer_state`` mapped: ``"DONE"``
    :data:`SUCCESS`, ``"PROC"`` :data:`IN_PROG`, anything else
    :data:`BACKEND`. The connectors' one reading of a transfer's end."""
    if _is_nixl_agent(agent):
        try:
            return xfer_status(agent, handle)
        except Exception as e:  # noqa: BLE001 - the status of the call
            return e
    try:
        state = agent.check_xfer_state(handle)
    except Exception as e:  # noqa: BLE001
        return e
    return {"DONE": SUCCESS, "PROC": IN_PROG}.get(state, BACKEND)


def _is_nixl_agent(agent: Any) -> bool:
    """Whether ``agent`` is NIXL's Python ``nixl_agent`` or a subclass of
    it, from any of NIXL's distributions (the class ``nixl_agent`` of a
    module ``<distribution>._api``: ``nixl._api``, ``nixl_cu12._api``), and
    never a stand-in of another class (vLLM's unit tests' fake agent, a
    plain ``MagicMock``). Read from ``agent.__class__``, as ``isinstance``
    reads it: a mock made with ``spec=nixl_agent`` counts, as it did for
    the vLLM connector's ``isinstance`` check this replaces. The one test
    of it, for this module and the connectors."""
    cls = getattr(agent, "__class__", type(agent))
    return any(c.__name__ == "nixl_agent" and c.__module__.rpartition(".")[2] == "_api" for c in cls.__mro__)


def _check_agent(agent: Any, conf: Any, progress: str) -> str:
    """Refuses an agent the service cannot share safely, warns where it
    cannot tell; returns how heartbeats reach the wire: ``progress_thread``,
    ``caller`` or ``unknown``."""
    if progress not in ("thread", "caller"):
        raise ValueError(
            f"progress={progress!r} is not accepted: \"thread\" (the agent's progress thread "
            "sends what the service posts) or \"caller\" (you call agent.get_new_notifs() or poll "
            "transfers at least once per heartbeat interval)"
        )
    if conf is None:
        conf = getattr(agent, _CONFIG_ATTR, None)
    if conf is None:
        if _is_nixl_agent(agent):
            warnings.warn(
                "nixl_keepalive: cannot check this nixl_agent's thread-sync mode or progress "
                "thread (nixl_agent keeps no copy of its config). NIXL's default sync mode, NONE, "
                "is a data race with the service's threads: make the agent with "
                "nixl_keepalive.make_agent(name) or nixl_agent(name, nixl_keepalive.agent_config()), "
                "and pass Keepalive(agent, agent_config=conf)",
                RuntimeWarning,
                stacklevel=3,
            )
        return "caller" if progress == "caller" else "unknown"
    mode = getattr(conf, "sync_mode", None)
    if mode is None:
        # nixl_agent's own default: STRICT with the listener thread, else NONE.
        mode_name = "NIXL_THREAD_SYNC_STRICT" if getattr(conf, "enable_listen", False) else "NIXL_THREAD_SYNC_NONE"
    else:
        mode_name = getattr(mode, "name", str(mode)).split(".")[-1]
    if mode_name not in _SAFE_SYNC_MODES:
        raise ConfigError(
            f"the agent's thread-sync mode is {mode_name}: the service calls the agent from its own "
            "threads, and NONE (NIXL's default) makes that a data race. Make the agent with "
            "sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_RW (nixl_keepalive.agent_config() does) "
            f"or STRICT; accepted: {', '.join(_SAFE_SYNC_MODES)}"
        )
    if getattr(conf, "enable_pthread", True):
        return "progress_thread"
    if progress != "caller":
        raise ConfigError(
            "the agent has no progress thread (enable_prog_thread=False): a heartbeat the service "
            "posts reaches the wire only when someone progresses the agent, and nothing would. "
            "Make the agent with enable_prog_thread=True, or pass Keepalive(..., progress=\"caller\") "
            "and call agent.get_new_notifs() (or poll transfers) at least once per heartbeat interval"
        )
    return "caller"


def _report_unknown_env() -> None:
    """Warns about each ``NIXL_KEEPALIVE_*`` variable no knob reads (a typo
    would otherwise leave its knob at the default, silently)."""
    accepted = [k["variable"] for k in knobs()]
    for var in _native.unknown_env_vars():
        close = difflib.get_close_matches(var, accepted, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        warnings.warn(
            f"nixl_keepalive: environment variable {var}={os.environ.get(var, '')!r} is not a "
            f"knob and is ignored{hint}; the knobs are {', '.join(accepted)}",
            RuntimeWarning,
            stacklevel=3,
        )


#: The keys a ``control`` mapping may have.
_CONTROL_KEYS = ("addr", "token", "token_file")


def _control_settings(
    control: Union[str, Mapping[str, Any], None], control_token: Optional[str]
) -> "tuple[Optional[str], Optional[str], Optional[str]]":
    """``Keepalive``'s ``control`` and ``control_token`` as the native
    service takes them: ``(addr, token, token_file)``. Its values are
    checked natively (the address, the token, loopback or not)."""
    if control is None:
        if control_token is not None:
            raise ConfigError("control_token without control: give the address to serve on too")
        return None, None, None
    if isinstance(control, str):
        settings: dict = {"addr": control}
    elif isinstance(control, Mapping):
        unknown = sorted(str(k) for k in control if k not in _CONTROL_KEYS)
        if unknown:
            raise ConfigError(f"control: unknown key(s) {', '.join(unknown)}; accepted: {', '.join(_CONTROL_KEYS)}")
        if "addr" not in control:
            raise ConfigError("control: no \"addr\" (the \"host:port\" to serve on, e.g. \"127.0.0.1:0\")")
        settings = dict(control)
    else:
        raise TypeError(
            f"control must be a \"host:port\" string or a mapping with {', '.join(_CONTROL_KEYS)}; "
            f"got {type(control).__name__}"
        )
    if control_token is not None:
        if settings.get("token") is not None:
            raise ConfigError("control: a token twice (control_token= and control[\"token\"]); give one")
        settings["token"] = control_token
    for key in _CONTROL_KEYS:
        if settings.get(key) is not None and not isinstance(settings[key], str):
            raise TypeError(f"control {key} must be a str; got {type(settings[key]).__name__}")
    return settings["addr"], settings.get("token"), settings.get("token_file")


#: One Keepalive per agent: id(agent) -> the live Keepalive (weakly).
_by_agent: "dict[int, weakref.ref[Keepalive]]" = {}
_by_agent_lock = threading.Lock()

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

    __slots__ = ("_service", "_address", "_declared", "_h")

    def __init__(self, service: _native.Service, address: str, declared: bool = False) -> None:
        self._service = service
        self._address = address
        self._declared = declared
        self._h: Optional[Handshake] = None

    def __enter__(self) -> Handshake:
        self._h = self._service.handshake(self._address, self._declared)
        return self._h

    def __exit__(self, *exc: object) -> None:
        if self._h is not None:
            self._h.finish()

    async def __aenter__(self) -> AsyncHandshake:
        self._h = self._service.handshake(self._address, self._declared)
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
            accepted; a ``NIXL_KEEPALIVE_*`` variable no knob reads is
            warned about (with the closest knob's name).
        agent_config: the ``nixl_agent_config`` the agent was made with
            (not needed for agents from :func:`make_agent`). With it, an
            agent in NIXL's default sync mode (NONE) is refused, and one
            without a progress thread is refused unless ``progress`` is
            ``"caller"``. Without it, a real ``nixl_agent`` gets a warning:
            its sync mode cannot be read back.
        progress: ``"thread"`` (the agent's progress thread puts posted
            heartbeats on the wire) or ``"caller"`` (you progress the agent:
            ``get_new_notifs()`` or transfer polls, at least once per
            heartbeat interval).
        control: serve the control endpoint for a router here (the
            library's server: ``POST /fault_tolerance/event``, ``POST
            /v1/peer_gone``, ``GET /v1/snapshot``, and ``GET /metrics``
            for Prometheus, from the process's recorder; see the operations
            guide): ``"host:port"`` (an IP literal or ``localhost``; port 0
            picks a free one, read back from :attr:`control_addr`), or a
            mapping with ``addr`` and ``token`` or ``token_file``. Stopped
            by :meth:`close`.
        control_token: the bearer token every POST to it (and, off
            loopback, every request) must carry. An address that is not
            loopback needs one. A bad address, token or bind raises
            :class:`ConfigError` before the service starts.

    One Keepalive per agent: a second one on an agent whose first is
    still running raises :class:`KeepaliveError`.

    Use it as a context manager (``with Keepalive(agent) as ka``), or call
    :meth:`close`.
    """

    def __init__(
        self,
        agent: Any,
        config: Optional[Config] = None,
        *,
        agent_config: Any = None,
        progress: str = "thread",
        control: Union[str, Mapping[str, Any], None] = None,
        control_token: Optional[str] = None,
        **knobs: Any,
    ) -> None:
        control_addr, token, token_file = _control_settings(control, control_token)
        if config is not None and knobs:
            raise TypeError("pass either a Config or keyword arguments, not both")
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config must be a nixl_keepalive.Config; got {type(config).__name__}")
        self._delivery = _check_agent(agent, agent_config, progress)
        if config is None:
            config = Config(**knobs)
        _report_unknown_env()
        self._config = config
        self._closed: Optional[dict] = None
        with _by_agent_lock:
            held = _by_agent.get(id(agent))
            other = held() if held is not None else None
            if other is not None and other.agent is agent and not other.closed:
                raise KeepaliveError(
                    f"this agent ({getattr(agent, 'name', agent)!r}) already has a running Keepalive: "
                    "one per agent (two would release each other's engines' state twice); share it, "
                    "or close() the first"
                )
            self._service = _native.Service(agent, config, control_addr, token, token_file)
            _by_agent[id(agent)] = weakref.ref(self)
        closing = endpoint_close_mode()
        if closing["mode"] == "unavailable":
            warnings.warn(
                "nixl_keepalive: releases cannot close a live prefill's UCX endpoints in this process "
                f"(one TCP connection per rank stays open per release): {closing['reason']}",
                RuntimeWarning,
                stacklevel=2,
            )
        gpu = gpu_mappings()
        if gpu["mode"] == "unavailable":
            warnings.warn(
                "nixl_keepalive: releases cannot give back the GPU mappings UCX's CUDA IPC cache keeps "
                f"(a dead prefill's memory stays allocated; set UCX_CUDA_IPC_CACHE=n): {gpu['reason']}",
                RuntimeWarning,
                stacklevel=2,
            )
        _live.add(self)

    # -- connecting -------------------------------------------------------

    def handshake(self, address: str, *, declared: bool = False) -> HandshakeScope:
        """The handshake protocol with the peer at ``address``
        (``host:port``): connect, reconnect, or reload a pinned engine id.
        ``with ka.handshake(addr) as h`` / ``async with``; see
        :class:`Handshake`.

        ``declared=True`` when ``address`` is the peer's own word (SGLang's
        decode registers its ``rank_ip:rank_port``), not where the runtime
        reached it: a claim of another engine id at an address a live
        engine holds raises :class:`IdentityConflict` (``conflict ==
        "address_in_use"``, ``holder`` the live one) instead of replacing
        it, and the holder is heartbeated at once. A holder that is gone is
        released on that heartbeat's REMOTE_DISCONNECT; a handshake after
        its release goes through."""
        return HandshakeScope(self._service, address, declared)

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
        return self._service.register(engine_id, address, agents, dlist_handles, incarnation)

    def engine(self, engine_id: str) -> Optional[Engine]:
        """The registered engine ``engine_id``, if any."""
        return self._service.engine(engine_id)

    # -- leases and the router -------------------------------------------

    def add_leases(self, engine: EngineLike, requests: Iterable[str], renew_now: bool = False) -> None:
        """Renews these request ids (vLLM's lease heartbeat, ``HB:id,...``)
        with every heartbeat to ``engine`` until removed. ``requests`` is a
        sequence of ids (a lone ``str`` is refused: it would lease each
        character)."""
        self._service.add_leases(engine, requests, renew_now)

    def remove_leases(self, engine: EngineLike, requests: Iterable[str]) -> None:
        """Stops renewing these request ids (on request completion)."""
        self._service.remove_leases(engine, requests)

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

    def snapshot(self) -> "Snapshot":
        """The service's table as plain dicts, the control endpoint's ``GET
        /v1/snapshot`` key for key (the library's one rendering; times in
        whole milliseconds under ``_ms`` keys): per engine its state,
        reads in flight, given-up transfers held, leases, last heartbeat
        and, in words, why it is kept or what its release waits for; and,
        the package's own, ``endpoints``: the close mode
        (:func:`endpoint_close_mode`), what the releases did to UCX
        endpoints so far (``closed``, ``left_open``, ``none_closed``,
        ``not_observed``) and to their TCP connections
        (``connections_shut``: recorded at loads made through
        :func:`load_remote_agent`, shut down at releases whose transfers
        had all ended), and UCX's own count of the endpoints the agent
        holds now (``ucx_endpoints``: NIXL's loopback endpoint plus one per
        connected remote agent; ``None`` without UCX's VFS); and
        ``heartbeat_delivery``: who puts posted heartbeats on the wire
        (``progress_thread``, ``caller``, or ``unknown``: a heartbeat's
        ``NIXL_SUCCESS`` says only that NIXL took it)."""
        snap = self._service.snapshot()
        snap["heartbeat_delivery"] = self._delivery
        return snap

    async def snapshot_async(self) -> "Snapshot":
        """:meth:`snapshot` as an awaitable."""
        snap = await self._service.snapshot_async()
        snap["heartbeat_delivery"] = self._delivery
        return snap

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
    def control_addr(self) -> Optional[str]:
        """Where the control server listens (``"host:port"``, with the port
        the system picked for port 0), or ``None`` without one."""
        return self._service.control_addr

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
