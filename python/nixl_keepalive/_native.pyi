"""Type stubs of the native module (``python/src/*.rs``)."""

from typing import Any, Awaitable, Callable, Iterator, AsyncIterator, Literal, Optional, Sequence, TypedDict, Union

__version__: str
# Every nixl_status_t, in NIXL's C++ numbering.
IN_PROG: int
SUCCESS: int
NOT_POSTED: int
INVALID_PARAM: int
BACKEND: int
NOT_FOUND: int
MISMATCH: int
NOT_ALLOWED: int
REPOST_ACTIVE: int
UNKNOWN: int
NOT_SUPPORTED: int
REMOTE_DISCONNECT: int
CANCELED: int
NO_TELEMETRY: int

EngineStateName = Literal["live", "unreachable", "replaced", "retiring", "stalled", "released"]
DestinationName = Literal["reusable", "retire"]
GiveUpName = Literal["timed_out", "cancelled"]

# An event's dict is its line's fields (``nixl-keepalive decode`` prints
# the line; the Rust crate's JSON has the same keys), made by the library's
# one walk of them (``Event::each_field``): ``kind``, then each field under
# the line's key. A status is its raw int with its name under
# ``<key>_name``, a time whole milliseconds under an ``_ms`` key.

class _EventBase(TypedDict, total=False):
    #: Set by the Python side's own collectors (tests), not by the service.
    at: float

class RegisteredEvent(_EventBase):
    kind: Literal["registered"]
    engine: str
    registration: int
    address: str

class UnreachableEvent(_EventBase):
    kind: Literal["unreachable"]
    engine: str
    registration: int
    status: int
    status_name: str
    source: Literal["heartbeat", "transfer"]

class ReplacedEvent(_EventBase):
    kind: Literal["replaced"]
    #: The engine that was at the address, and its registration (released
    #: once idle).
    old: str
    old_registration: int
    #: The engine there now.
    new: str
    address: str

class RetiringEvent(_EventBase):
    kind: Literal["retiring"]
    engine: str
    registration: int
    fail_reads: bool

class StalledEvent(_EventBase):
    kind: Literal["stalled"]
    engine: str
    registration: int
    #: Reads in flight when it was found stalled.
    reads: int
    #: How long at least it had a read outstanding and none completed.
    stalled_ms: int
    given_up: int
    failed: bool

class ReadsFailedEvent(_EventBase):
    kind: Literal["reads_failed"]
    engine: str
    registration: int
    count: int

class TransientErrorEvent(_EventBase):
    kind: Literal["transient_error"]
    engine: str
    registration: int
    status: int
    status_name: str
    source: Literal["heartbeat", "transfer"]

class ReleasedEvent(_EventBase):
    kind: Literal["released"]
    engine: str
    registration: int
    reason: str
    #: From the engine's mark to the start of its release.
    waited_ms: int
    #: Reads in flight when it was marked.
    reads_at_mark: int
    #: Whether a handshake at its address held the release back.
    handshake: bool
    failed_steps: int
    panicked: bool
    endpoints_left_open: int

class ConflictEvent(_EventBase):
    kind: Literal["conflict"]
    #: What collided (``agent_in_use``, ``address_in_use``, ...): the
    #: line's and the JSON's ``kind``, which the event's own kind would hide.
    conflict: str
    engine: str
    #: The conflict in words.
    detail: str

class TransportPanickedEvent(_EventBase):
    kind: Literal["transport_panicked"]
    engine: str
    registration: int
    call: str
    message: str

class LaggedEvent(TypedDict):
    kind: Literal["lagged"]
    missed: int

Event = Union[
    RegisteredEvent,
    UnreachableEvent,
    ReplacedEvent,
    RetiringEvent,
    StalledEvent,
    ReadsFailedEvent,
    TransientErrorEvent,
    ReleasedEvent,
    ConflictEvent,
    TransportPanickedEvent,
    LaggedEvent,
]

# The snapshot's one rendering: the library's, which `GET /v1/snapshot`
# answers too (times in whole milliseconds under `_ms` keys).

class LastHeartbeat(TypedDict):
    ago_ms: int
    status: int
    status_name: str

class GivenUpSnapshot(TypedDict):
    held_for_ms: int
    blocks: int

class EngineSnapshot(TypedDict):
    engine: str
    address: str
    #: The process's incarnation as a decimal string; None when its
    #: handshake carried none.
    incarnation: Optional[str]
    agents: list[str]
    state: EngineStateName
    reads_in_flight: int
    given_up: list[GivenUpSnapshot]
    leases: list[str]
    last_heartbeat: Optional[LastHeartbeat]
    next_heartbeat_in_ms: Optional[int]
    transient_errors: int
    why: str

class HandshakesPending(TypedDict):
    address: str
    count: int

class DetectionBound(TypedDict):
    crashed: Optional[int]
    silent: Optional[int]
    frozen: Optional[int]

class CallInFlight(TypedDict):
    engine: str
    call: str
    age_ms: int
    hung: bool

class TransportSnapshot(TypedDict):
    threads: int
    idle: int
    cap: int
    queued: int
    hung_total: int
    in_flight: list[CallInFlight]

class EndpointsSnapshot(TypedDict, total=False):
    mode: str
    reason: Optional[str]
    closed: int
    left_open: int
    none_closed: int
    not_observed: int
    connections_shut: int
    ucx_endpoints: Optional[int]

class Snapshot(TypedDict, total=False):
    engines: list[EngineSnapshot]
    handshakes_pending: list[HandshakesPending]
    waiting_for_reload: list[str]
    silent_peer_note: str
    limiter_keys: int
    heartbeat_timers: int
    #: Milliseconds.
    detection_bound_ms: Optional[DetectionBound]
    transport: TransportSnapshot
    #: Added by the package (not served over HTTP): what releases did to
    #: the agent's UCX endpoints.
    endpoints: EndpointsSnapshot
    #: Added by ``Keepalive.snapshot``: who puts posted heartbeats on the wire.
    heartbeat_delivery: Literal["progress_thread", "caller", "unknown"]

class KeepaliveError(Exception):
    """Base class of nixl_keepalive's errors."""

class ConfigError(KeepaliveError, ValueError):
    """A configuration value was refused (every refused value is in the
    message and in ``errors``)."""

    errors: list[dict[str, str]]

class ServiceStopped(KeepaliveError):
    """The keepalive service has stopped; nothing was done."""

class ReadRefused(KeepaliveError):
    """A read was not started: the engine is not live."""

    engine: str
    state: str

class RegistrationRefused(KeepaliveError):
    """The service did not take a registration; ``registration`` holds it
    whole (engine, address, agents, kept_agents, dlist_handles) to give
    back. ``reason``: stopped, conflict, invalid, service_gone."""

    reason: str
    engine: str
    conflict: Optional[str]
    agent: Optional[str]
    holder: Optional[str]
    registration: Optional[dict[str, Any]]

class IdentityConflict(KeepaliveError):
    """A handshake's claim conflicts with a registered engine (``conflict``:
    agent_in_use, engine_elsewhere, address_in_use, agents_changed, ...);
    nothing may be loaded, the registered engine is kept. ``holder``: the
    engine holding the agent name (agent_in_use) or the declared address
    (address_in_use)."""

    conflict: str
    engine: str
    agent: Optional[str]
    holder: Optional[str]

class ReleaseHeld(KeepaliveError):
    """``Handshake.ready_to_load`` waited its ``timeout`` for an older
    registration of the engine id to be released, and transfers of it still
    run (reads in flight, given-up reads) that only the runtime ends:
    often the very thread that waited. Nothing was loaded, the handshake
    has ended; end those transfers, then handshake again. ``state`` and
    the counts are ``None`` when no registration of the id was left."""

    engine: str
    state: Optional[str]
    reads_in_flight: Optional[int]
    given_up: Optional[int]
    given_up_blocks: Optional[int]
    waited: float
    why: str

Status = Union[int, str, BaseException, type]

class Config:
    """The service's configuration: ``NIXL_KEEPALIVE_*`` knobs as keyword
    arguments (``interval``, ``jitter``, ``rate_period``, ``rate_burst``,
    ``event_capacity``, ``shutdown_drain``, ``metrics_period``,
    ``read_stall``, ``read_stall_action``, ``endpoint_events`` and
    ``gpu_unmap``: a bool or ``"on"``/``"off"``) over the environment
    (``env=False`` ignores it); ``seed`` fixes the jitter's randomness.
    Time values: UCX syntax strings (``"250ms"``, ``"inf"``), seconds, or
    ``timedelta``. Raises :class:`ConfigError`."""

    def __init__(self, *, env: bool = True, seed: Optional[int] = None, **knobs: Any) -> None: ...
    def as_dict(self) -> dict[str, Any]:
        """The configuration in force, by keyword (seconds; ``None``:
        disabled)."""

class Engine:
    """A registered prefill engine (one registration of it)."""

    @property
    def id(self) -> str: ...
    @property
    def address(self) -> str: ...
    @property
    def agents(self) -> list[str]: ...
    @property
    def incarnation(self) -> Optional[int]: ...
    @property
    def state(self) -> EngineStateName:
        """live, unreachable, replaced, retiring, stalled or released.
        ``released`` is set when the release begins; that its NIXL calls
        have returned is what :meth:`wait_released` / :meth:`released`
        say."""
    @property
    def is_live(self) -> bool: ...
    @property
    def reads_in_flight(self) -> int: ...
    @property
    def reads_failed(self) -> bool: ...
    def read(self) -> Read:
        """Starts a read (a context manager); raises :class:`ReadRefused`
        at once when the engine is not live."""
    def write(self) -> Read:
        """Starts a push-mode write into this engine (the same guard as a
        read: no release while it is open); raises :class:`ReadRefused`
        at once when the engine is not live."""
    def adopt_posted_read(self) -> Read:
        """Accounts for a transfer already running without a guard (posted
        by code that bypassed :meth:`read`): the same guard, granted on a
        marked engine too, so the engine is not released before the
        transfer ends; raises :class:`ReadRefused` only once the engine is
        released (``state == "released"``) or too many reads are in
        flight. Never use it to start a transfer."""
    def report_transfer(self, status: Status) -> None:
        """Reports how a transfer not tracked with :meth:`read` ended."""
    def wait_released(self, timeout: Optional[float] = None) -> bool:
        """Waits until this registration is released; ``False`` on timeout."""
    def released(self) -> Awaitable[None]:
        """Resolves once this registration is released."""
    def on_released(self, callback: Callable[["Engine"], object]) -> None:
        """Calls ``callback(engine)`` once, on the service's thread, when
        released (at once if it already is)."""

class Read:
    """One read in flight; leaving its ``with`` block ends it."""

    @property
    def engine(self) -> str: ...
    @property
    def failed(self) -> bool:
        """The service failed this engine's reads: abandon the transfer."""
    @property
    def open(self) -> bool: ...
    def finish(self, status: Status) -> None:
        """Ends the read with the transfer's raw status (int), the NIXL
        exception it raised, or ``"DONE"``. A refused status still ends
        the read (then raises); ``"PROC"`` leaves it open."""
    def give_up(self, why: GiveUpName, blocks: int = 0) -> GivenUpRead:
        """Gives the read up (``GiveUp.TIMED_OUT`` or ``GiveUp.CANCELLED``):
        fail its request now, keep polling the transfer and call
        ``ended(status)`` on the token when it stops being in progress;
        the engine is not released before."""
    def close(self) -> None: ...
    def __enter__(self) -> Read: ...
    def __exit__(self, *exc: object) -> bool: ...

class GivenUpRead:
    """The token of a given-up read's destination buffer."""

    @property
    def engine(self) -> str: ...
    @property
    def why(self) -> GiveUpName: ...
    @property
    def watched(self) -> bool: ...
    def ended(self, status: Status) -> DestinationName:
        """The transfer ended with this raw status: ``"reusable"``."""
    def abandon(self) -> None:
        """Stops watching the transfer: the release decides the buffer."""
    def try_destination(self) -> Optional[DestinationName]: ...
    def wait_destination(self, timeout: Optional[float] = None) -> Optional[DestinationName]: ...
    def destination(self) -> Awaitable[DestinationName]: ...

class Handshake:
    """A handshake in progress with one prefill address."""

    @property
    def address(self) -> str: ...
    @property
    def ended(self) -> bool: ...
    def ready_to_load(
        self,
        engine_id: str,
        agents: Sequence[Union[str, bytes]],
        incarnation: Optional[int] = None,
        timeout: Optional[float] = 5.0,
    ) -> Optional[Engine]:
        """``None``: load now, then :meth:`register`. An ``Engine``: this
        exact incarnation is already registered; load nothing. Waits at most
        ``timeout`` seconds (``None``: no limit) for an older registration
        of the id to be released. Raises :class:`IdentityConflict`,
        :class:`ReleaseHeld` or :class:`ServiceStopped`."""
    def ready_to_load_async(
        self, engine_id: str, agents: Sequence[Union[str, bytes]], incarnation: Optional[int] = None
    ) -> Awaitable[Optional[Engine]]: ...
    def register(self, dlist_handles: Sequence[Any]) -> Engine:
        """Registers the loaded engine with its prepped remote dlist
        handles; raises :class:`RegistrationRefused`."""
    def register_async(self, dlist_handles: Sequence[Any]) -> Awaitable[Engine]: ...
    def claim_agent(self, agent: Union[str, bytes]) -> None:
        """Claims a name ``add_remote_agent`` returned that the reply did
        not list, before unloading it; :class:`IdentityConflict`: leave it
        loaded (another engine's)."""
    def finish(self) -> None: ...

class Events:
    """The service's events as dicts (``kind``, ``engine``, ...)."""

    def get(self, timeout: Optional[float] = None) -> Optional[Event]:
        """The next event, or ``None`` after ``timeout`` seconds; raises
        :class:`ServiceStopped` once the service stopped and every event
        was read."""
    def get_nowait(self) -> Optional[Event]: ...
    def get_line_nowait(self) -> Optional[tuple[Event, str]]:
        """The next event if one is waiting, with its one line (what
        ``nixl-keepalive decode`` prints after ``event: ``), else ``None``;
        missed events as ``({"kind": "lagged", "missed": n}, "(n events
        missed)")``."""
    def __iter__(self) -> Iterator[Event]: ...
    def __next__(self) -> Event: ...
    def __aiter__(self) -> AsyncIterator[Event]: ...
    def __anext__(self) -> Awaitable[Event]: ...

class Service:
    """The running service (wrapped by :class:`nixl_keepalive.Keepalive`)."""

    def __init__(
        self,
        agent: Any,
        config: Config,
        control_addr: Optional[str] = None,
        control_token: Optional[str] = None,
        control_token_file: Optional[str] = None,
    ) -> None: ...
    @property
    def agent(self) -> Any: ...
    @property
    def stopped(self) -> bool: ...
    @property
    def control_addr(self) -> Optional[str]:
        """The control server's ``host:port``, or ``None`` without one."""
    def handshake(self, address: str, declared: bool = False) -> Handshake: ...
    def register(
        self,
        engine_id: str,
        address: str,
        agents: Sequence[str],
        dlist_handles: Sequence[Any],
        incarnation: Optional[int] = None,
    ) -> Engine: ...
    def engine(self, engine_id: str) -> Optional[Engine]: ...
    def add_leases(self, engine: Union[str, Engine], requests: Sequence[str], renew_now: bool = False) -> None: ...
    def remove_leases(self, engine: Union[str, Engine], requests: Sequence[str]) -> None: ...
    def renew_leases(self, engine: Union[str, Engine]) -> None: ...
    def peer_gone(
        self, engine: Optional[Union[str, Engine]] = None, *, address: Optional[str] = None, mode: str = "drain"
    ) -> None: ...
    def snapshot(self) -> Snapshot: ...
    def snapshot_async(self) -> Awaitable[Snapshot]: ...
    def events(self) -> Events: ...
    def close(self) -> dict[str, Any]: ...
    def close_async(self) -> Awaitable[dict[str, Any]]: ...
    def give_back(self, registration: dict[str, Any]) -> list[dict[str, Any]]: ...
    def transport_stats(self) -> dict[str, Any]: ...

def status_name(status: int) -> str:
    """The name of a raw NIXL status (``NIXL_ERR_REMOTE_DISCONNECT``)."""

def classify_exception(exc: Union[BaseException, type]) -> Optional[int]:
    """The raw status a NIXL exception stands for; ``None`` if not NIXL's."""

def xfer_status(agent: Any, handle: Any) -> int:
    """The raw status of a transfer (``agent.agent.getXferStatus``), where
    ``check_xfer_state`` collapses errors to ``"ERR"``."""

def canonical_address(address: str) -> str:
    """The canonical ``host:port`` the service compares (the Rust rule);
    ``ValueError`` for anything else."""

def unknown_env_vars() -> list[str]:
    """``NIXL_KEEPALIVE_*`` variables set that no knob reads."""

def knobs() -> list[dict[str, str]]:
    """Every knob: keyword, variable, default, syntax, meaning, and kind
    (``"time"``, ``"count"``, ``"word"``, ``"switch"``: what its keyword
    takes), from the service's own knob table."""

def endpoint_close_mode() -> dict[str, Optional[str]]:
    """How releases close a released agent's UCX endpoints in this process:
    ``{"mode": "force" | "nixl" | "unavailable" | "pending", "reason"}``."""

def gpu_mappings() -> dict[str, Any]:
    """What releases do with the GPU mappings UCX's CUDA IPC cache keeps:
    ``{"mode": "unmapping" | "off" | "none" | "pending" | "unavailable",
    "reason", "counts"}`` (docs/design/gpu-mappings.md)."""

def remove_remote_agent(agent: Any, name: str) -> dict[str, Any]:
    """``agent.remove_remote_agent(name)`` with its endpoints closed as the
    service's releases close them, and the TCP connections its loads
    through :func:`load_remote_agent` opened shut down (call it only when
    no transfer with the agent may be running):
    ``{"status", "status_name", "close", "connections_shut"}``."""

def parse_ucx_time(value: str) -> Optional[float]:
    """A UCX time string (``"5s"``, ``"250ms"``, ``"inf"``) in seconds,
    ``None`` for ``inf``: the service's own parser of UCX's syntax.
    ``ValueError`` (naming what is accepted) for anything else."""

def load_remote_agent(agent: Any, load: Callable[[], Any]) -> Any:
    """Calls ``load()`` (``agent.add_remote_agent(md)``, or a method around
    it) and names the UCX endpoints it created, and the TCP connections UCX
    opened for them, after the agent it returned: a failure of one sends
    that engine alone a heartbeat, and the engine's release shuts its
    connections down. Loads through this run one at a time per process."""

def bench_read_guards(engine: Engine, n: int) -> float: ...
def bench_service_heartbeats(engines: int, interval: float, seconds: float) -> int: ...
