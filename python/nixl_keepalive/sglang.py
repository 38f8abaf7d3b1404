"""The keepalive service inside SGLang 0.5.23's NIXL prefill (push mode).

SGLang's NIXL backend is push mode: the prefill's ``NixlKVManager`` loads
every decode's agent metadata and WRITEs the KV cache into the decode's
pages, so it is the prefill that holds keys to every decode's memory, and
nothing in SGLang releases a dead decode's NIXL state (its only NIXL re-load,
``_reload_invalidated_peers``, loads a peer NIXL dropped *again*).
:class:`KeepaliveNixlKVManager` is SGLang's ``NixlKVManager`` with
:class:`nixl_keepalive.Keepalive` embedded on the prefill side:

- the service heartbeats every decode SGLang added (``HB:`` notifications
  through the manager's own agent, which SGLang makes with NIXL's STRICT
  thread-sync mode: the agent's config is the one SGLang passed, seen at
  the call, not assumed);
- every decode SGLang adds (``_add_remote_peer``, from its bootstrap thread)
  goes through the service's handshake: claimed (the decode's agent name as
  its engine id, at its ``rank_ip:rank_port``) before its metadata is
  loaded, registered with the dlists SGLang prepped for it after;
- every transfer SGLang makes on the agent (``make_prepped_xfer``,
  ``initialize_xfer``) runs under a write guard opened *before* NIXL is
  called, so a decode is never released with a write into it in flight,
  and a released decode's dlists are never used: the guard is refused and
  the room fails. It ends with the transfer's state as SGLang polls it
  (``check_xfer_state``: ``DONE``, or ``ERR`` with NIXL's raw status,
  where ``REMOTE_DISCONNECT`` marks the decode at once); a batch SGLang
  stops waiting for (``_await_handles`` unsettled) is given up;
- a decode the service released is dropped from SGLang's tables
  (``decode_kv_args_table``, ``prep_handles``, ``prep_handles_slice_dst``,
  ``_prepared_state_plans``, ``_peer_reload_times``), and
  ``_reload_invalidated_peers`` skips every decode that is not live, so a
  dead decode's metadata is not loaded back.

The decode side runs SGLang's own manager (in push mode the keepalive
lives where the keys are held) with one addition: a thread that takes the
NIXL notifications SGLang's decode never reads, so the prefills'
heartbeats do not pile up in its agent. :func:`install` makes SGLang build
this class wherever it builds its NIXL manager, for both roles.

Knobs: the ``NIXL_KEEPALIVE_*`` variables (``NIXL_KEEPALIVE_INTERVAL=1s``,
...), or ``keepalive`` keywords given to the constructor. See
docs/push-mode.md, "SGLang 0.5.23".

Supported: SGLang 0.5.23 (checked when the manager is built).
"""

from __future__ import annotations

import importlib.metadata
import logging
import sys
import threading
import time
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import nixl_keepalive
from nixl_keepalive import GiveUp, Keepalive

SUPPORTED_SGLANG = ("0.5.23",)
"""The SGLang releases this module is written against (exact: SGLang's
NIXL manager changes between patch releases)."""

try:
    from sglang.srt.disaggregation import nixl as _sglang_nixl
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager
    from sglang.srt.disaggregation.utils import DisaggregationMode
except ImportError as _e:  # SGLang missing, or a layout this module does not know
    raise ImportError(
        "nixl_keepalive.sglang needs SGLang "
        f"{', '.join(SUPPORTED_SGLANG)} (sglang.srt.disaggregation.nixl): {_e}"
    ) from _e

logger = logging.getLogger("nixl_keepalive.sglang")

__all__ = ["SUPPORTED_SGLANG", "KeepaliveNixlKVManager", "check_sglang_version", "install"]


def check_sglang_version(version: Optional[str] = None) -> str:
    """Raises ``RuntimeError`` naming the SGLang version found and the
    supported ones unless it is supported; returns the version."""
    if version is None:
        try:
            version = importlib.metadata.version("sglang")
        except importlib.metadata.PackageNotFoundError:
            version = None
    if version not in SUPPORTED_SGLANG:
        raise RuntimeError(
            f"nixl_keepalive.sglang supports SGLang {', '.join(SUPPORTED_SGLANG)}; found "
            f"{'no SGLang' if version is None else 'SGLang ' + version}. Install sglang==0.5.23 "
            "(scripts/install-sglang.sh), or run SGLang's own NixlKVManager without the keepalive."
        )
    return version


def install() -> None:
    """Makes SGLang build :class:`KeepaliveNixlKVManager` wherever it builds
    its NIXL manager (``get_kv_class`` imports the class from
    ``sglang.srt.disaggregation.nixl`` at each call). Call it in the process
    that builds the manager (the scheduler), before it is built, and after
    ``import nixl_keepalive`` came before the process's first ``nixl_agent``."""
    check_sglang_version()
    _sglang_nixl.NixlKVManager = KeepaliveNixlKVManager


# The agent SGLang makes: NixlKVManager.__init__ imports `nixl_agent` from
# NIXL's `nixl._api` module and calls it with the config it built. While our
# constructor runs (under this lock) that name records the (agent, config)
# pair, so the service is told the config SGLang really used.
_agent_record_lock = threading.Lock()


class _RecordingAgentClass:
    def __init__(self, real: Any) -> None:
        self.real = real
        self.made: List[Any] = []

    def __call__(self, name: Any, conf: Any = None, *args: Any, **kwargs: Any) -> Any:
        agent = self.real(name, conf, *args, **kwargs)
        self.made.append((agent, conf))
        return agent


class _GuardedAgent:
    """SGLang's agent as its transfer code sees it: every transfer runs
    under the decode's write guard, from before NIXL is called until SGLang
    sees it end. Everything else is the agent's own."""

    def __init__(self, real: Any, manager: "KeepaliveNixlKVManager") -> None:
        self._real = real
        self._manager = manager
        self._guards: Dict[Any, Any] = {}
        self._guards_lock = threading.Lock()
        self.given_up = 0
        #: Given-up writes still running, polled to their end (they fence
        #: their decode: not released under them), by handle.
        self._watched: Dict[Any, Any] = {}
        self._watcher: Optional[threading.Thread] = None
        #: Given-up writes seen to end, and how they ended (NIXL status names).
        self.given_up_ended: Dict[str, int] = {}
        #: Decodes a write to which ended in an error: not frozen but failing.
        self._failing: set = set()
        #: Transfers refused because no registered decode holds their remote
        #: dlist or agent (a released decode's, or one the service never
        #: registered): nothing reached NIXL.
        self.refused_unguarded = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def prep_xfer_dlist(self, agent_name: Any, *args: Any, **kwargs: Any) -> Any:
        # A dlist SGLang preps for a registered decode after its
        # registration (the prepared state plans): writes to it are that
        # decode's, under its guard.
        handle = self._real.prep_xfer_dlist(agent_name, *args, **kwargs)
        if handle is not None and agent_name not in ("", b""):
            self._manager._ka_adopt_dlist(agent_name, handle)
        return handle

    def _guarded(self, engine: Any, operation: Any, make: Any, target: Tuple[str, Any] = ("", None)) -> Any:
        if engine is None:
            # No registered decode holds this transfer's remote side: a
            # released decode's stale dlist or agent, or one the service
            # never registered. Posting it would write with no guard, where
            # a release may already have taken the keys (docs/push-mode.md:
            # a released decode's dlists are never used): refused, nothing
            # reaches NIXL, the room fails in SGLang's own error path.
            with self._guards_lock:
                self.refused_unguarded += 1
            kind, key = target
            why = self._manager._ka_why_unknown(kind, key)
            logger.warning("nixl_keepalive: a %s to %s %s refused: %s", operation, kind, key, why)
            raise nixl_keepalive.ReadRefused(
                f"nixl_keepalive: {operation} refused: its remote {kind} {key} belongs to no registered "
                f"decode ({why}); nothing was posted"
            )
        # Refused (ReadRefused) at once when the decode is not live: nothing
        # reaches NIXL, the room fails in SGLang's own error path.
        guard = engine.write() if str(operation).upper() == "WRITE" else engine.read()
        try:
            handle = make()
        except BaseException as e:  # nothing was posted
            nixl_keepalive._end_transfer_guard(guard, e)
            raise
        if not handle:
            guard.close()
            return handle
        with self._guards_lock:
            self._guards[handle] = guard
        return handle

    def make_prepped_xfer(self, operation: Any, local_xfer_side_handle: Any, local_indices: Any,
                          remote_xfer_side_handle: Any, remote_indices: Any, *args: Any, **kwargs: Any) -> Any:
        engine = self._manager._ka_engine_of_dlist(remote_xfer_side_handle)
        return self._guarded(engine, operation, lambda: self._real.make_prepped_xfer(
            operation, local_xfer_side_handle, local_indices, remote_xfer_side_handle, remote_indices,
            *args, **kwargs), ("dlist", _dlist_key(remote_xfer_side_handle)))

    def initialize_xfer(self, operation: Any, local_descs: Any, remote_descs: Any, remote_agent: Any,
                        *args: Any, **kwargs: Any) -> Any:
        engine = self._manager._ka_engine_of_agent(remote_agent)
        name = remote_agent.decode() if isinstance(remote_agent, bytes) else str(remote_agent)
        return self._guarded(engine, operation, lambda: self._real.initialize_xfer(
            operation, local_descs, remote_descs, remote_agent, *args, **kwargs), ("agent", name))

    def _take(self, handle: Any) -> Any:
        with self._guards_lock:
            return self._guards.pop(handle, None)

    def transfer(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            state = self._real.transfer(handle, *args, **kwargs)
        except BaseException as e:
            self._end(handle, e)
            raise
        if state == "ERR":
            self._end(handle, self._raw_status(handle))
        return state

    def check_xfer_state(self, handle: Any) -> Any:
        # An exception leaves the guard open: SGLang counts an unreadable
        # state as running (the write may still land), and so does the guard
        # until SGLang gives the batch up.
        state = self._real.check_xfer_state(handle)
        if state == "DONE":
            self._end(handle, "DONE")
        elif state == "ERR":
            self._end(handle, self._raw_status(handle))
        return state

    def release_xfer_handle(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        # A released request can no longer be watched: its write is
        # abandoned (the decode may then be released under it, see
        # nixl_keepalive.GivenUpRead).
        guard = self._take(handle)
        if guard is not None:
            guard.give_up(GiveUp.CANCELLED).abandon()
            self.given_up += 1
        with self._guards_lock:
            watched = self._watched.pop(handle, None)
        if watched is not None:
            watched[0].abandon()
        return self._real.release_xfer_handle(handle, *args, **kwargs)

    def _raw_status(self, handle: Any) -> Any:
        return nixl_keepalive._raw_status(self._real, handle)

    def _end(self, handle: Any, outcome: Any) -> None:
        guard = self._take(handle)
        if guard is None:
            return
        if outcome != "DONE" and outcome != 0:
            with self._guards_lock:
                self._failing.add(guard.engine)
        try:
            nixl_keepalive._end_transfer_guard(guard, outcome)
        except (TypeError, ValueError) as e:
            # A status the guard refuses (not NIXL's) still ended the write.
            logger.warning("nixl_keepalive: a transfer's end was not a NIXL status: %s", e)

    def give_up_open(self, handles: List[Any], why: GiveUp) -> int:
        """Gives up every still-open guard of ``handles`` (SGLang stopped
        waiting for them); returns how many. Each write is then polled to
        its end in a thread of ours: it completes when a frozen decode
        resumes and fails when it dies, and until then its decode is not
        released (the write may still use the decode's keys)."""
        n = 0
        for handle in handles:
            guard = self._take(handle)
            if guard is not None:
                given_up = guard.give_up(why)
                ka = getattr(self._manager, "_ka", None)
                engine = ka.engine(given_up.engine) if ka is not None else None
                with self._guards_lock:
                    self._watched[handle] = (given_up, engine)
                n += 1
        self.given_up += n
        if n:
            self._start_watcher()
        return n

    def _start_watcher(self) -> None:
        with self._guards_lock:
            if self._watcher is not None and self._watcher.is_alive():
                return
            self._watcher = threading.Thread(target=self._watch, name="nixl-keepalive-given-up", daemon=True)
            self._watcher.start()

    def _gone(self, engine_id: str, now: float, probed: Dict[str, float]) -> bool:
        """Whether UCX says the decode ``engine_id`` is gone: an idle
        heartbeat (``HB:``, what the service sends) through the real agent
        answers REMOTE_DISCONNECT. At most one per ``_PROBE_EVERY_S`` per
        decode. Needed because a marked decode gets no more heartbeats from
        the service, and a write into a decode SIGKILLed while frozen was
        measured to stay in progress for as long as it was watched (90 s)
        while a notification to it failed at once (test_sglang_real.py)."""
        if now - probed.get(engine_id, float("-inf")) < _PROBE_EVERY_S:
            return False
        probed[engine_id] = now
        try:
            self._real.send_notif(engine_id, b"HB:")
        except Exception as e:  # noqa: BLE001 - NIXL's errors, classified
            return nixl_keepalive.classify_exception(e) == nixl_keepalive.REMOTE_DISCONNECT
        return False

    def _watch(self) -> None:
        """Polls the given-up writes until none is left."""
        probed: Dict[str, float] = {}
        while True:
            time.sleep(0.01)
            with self._guards_lock:
                watched = list(self._watched.items())
                if not watched:
                    self._watcher = None
                    return
            gone: Dict[str, bool] = {}
            now = time.monotonic()
            for handle, (given_up, engine) in watched:
                with self._guards_lock:
                    failing = given_up.engine in self._failing
                state = engine.state if engine is not None else None
                if given_up.engine not in gone:
                    # A live decode is heartbeated by the service, which
                    # marks it unreachable on REMOTE_DISCONNECT.
                    gone[given_up.engine] = state not in (None, "live", "unreachable") and self._gone(
                        given_up.engine, now, probed)
                if failing or state == "unreachable" or gone[given_up.engine]:
                    # The decode's writes fail (a frozen one's stay in
                    # progress) or UCX says it is gone: a WRITE into a
                    # SIGKILLed decode was measured to stay in progress
                    # past SGLang's settle timeout while its sibling failed
                    # at once, and both to stay in progress for 90 s when
                    # it was killed while frozen (test_sglang_real.py).
                    # Abandoned: its keys are released now, as before the
                    # fence (SGLang already freed the source pages when it
                    # gave the room up).
                    given_up.abandon()
                    with self._guards_lock:
                        self._watched.pop(handle, None)
                        self.given_up_ended["abandoned_unreachable"] = (
                            self.given_up_ended.get("abandoned_unreachable", 0) + 1)
                    logger.info("nixl_keepalive: a given-up write to unreachable decode %s abandoned",
                                given_up.engine)
                    continue
                try:
                    state = self._real.check_xfer_state(handle)
                except Exception:  # noqa: BLE001 - unreadable: still running, as SGLang counts it
                    continue
                if state not in ("DONE", "ERR"):
                    continue
                status = "DONE" if state == "DONE" else self._raw_status(handle)
                try:
                    given_up.ended(status)
                except (TypeError, ValueError):
                    given_up.ended(nixl_keepalive.BACKEND)  # over, with a status that is not NIXL's
                name = "DONE" if state == "DONE" else (
                    nixl_keepalive.status_name(status) if isinstance(status, int) else type(status).__name__)
                with self._guards_lock:
                    self._watched.pop(handle, None)
                    self.given_up_ended[name] = self.given_up_ended.get(name, 0) + 1
                logger.info("nixl_keepalive: a given-up write ended (%s): its decode is no longer held by it", name)

    def watched(self) -> int:
        """Given-up writes still running."""
        with self._guards_lock:
            return len(self._watched)

    def open_guards(self) -> int:
        with self._guards_lock:
            return len(self._guards)


#: How often a watched decode the service no longer heartbeats is asked,
#: with an idle heartbeat, whether UCX still reaches it.
_PROBE_EVERY_S = 0.5

#: Released decodes' dlists remembered, to say whose a stale one was.
_STALE_KEPT = 4096


def _dlist_key(handle: Any) -> Any:
    """A prepped dlist's identity: NIXL's handle number (the Python
    ``nixl_prepped_dlist_handle`` wraps it in ``_handle``), or the value."""
    return getattr(handle, "_handle", handle)


# How long a registration declaring a live decode's address waits for that
# decode's fate. The service heartbeats the holder at once, under its rate
# cap (admitted at once with the default burst of 2, else within one rate
# period, min(interval, 1 s) by default); a decode that is gone answers
# REMOTE_DISCONNECT within a round trip and is released. Two rate periods,
# at least 1 s and at most 5 s: SGLang's bootstrap thread, which serves
# every registration and room, waits this long only when a live decode
# holds the declared address.
_DECLARED_WAIT_MIN_S, _DECLARED_WAIT_MAX_S = 1.0, 5.0
# How long a live decode that outlived a wait is refused at once.
_DECLARED_REWAIT_S = 30.0


def _declared_wait(config: Any) -> float:
    return min(_DECLARED_WAIT_MAX_S, max(_DECLARED_WAIT_MIN_S, 2.0 * config.as_dict()["rate_period"]))


def _peer_address(endpoint: str, port: int) -> str:
    host = endpoint.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class KeepaliveNixlKVManager(NixlKVManager):
    """SGLang's ``NixlKVManager`` with the keepalive service on the prefill
    side. ``keepalive`` takes :class:`nixl_keepalive.Config` keywords
    (``interval``, ``read_stall``, ...), over the ``NIXL_KEEPALIVE_*``
    variables. ``control`` (a prefill-mode manager) is
    :class:`nixl_keepalive.Keepalive`'s: the control endpoint, whose
    ``GET /metrics`` serves the service's metrics to Prometheus. A
    decode-mode manager is SGLang's own (no service) with one
    addition: every ``drain_every`` seconds (``None``: never) it takes the
    NIXL notifications waiting in its agent, which SGLang's decode never
    reads, so the prefills' heartbeats do not pile up there."""

    def __init__(self, args: Any, disaggregation_mode: Any, server_args: Any,
                 is_mla_backend: Optional[bool] = False, *, keepalive: Optional[Dict[str, Any]] = None,
                 drain_every: Optional[float] = 1.0, control: Union[str, Mapping[str, Any], None] = None,
                 **kwargs: Any) -> None:
        self._ka: Optional[Keepalive] = None
        self._ka_ready = threading.Event()
        self._ka_lock = threading.Lock()
        self._ka_by_agent: Dict[str, Any] = {}
        self._ka_by_dlist: Dict[Any, Any] = {}
        # The dlists of released decodes, by handle: a transfer naming one
        # is refused, saying whose it was.
        self._ka_stale: Dict[Any, str] = {}
        self._ka_released: List[str] = []
        self._ka_dropped: Dict[str, threading.Event] = {}
        #: Decode registrations refused before anything was loaded.
        self.refused_registrations = 0
        #: Registrations that declared the address of a live decode (each
        #: made the service heartbeat that decode at once).
        self.declared_conflicts = 0
        #: Of those, the ones that waited for the live decode's fate (the
        #: others came while it had outlived a wait lately: refused at once).
        self.declared_waits = 0
        # Live decodes that outlived a declaration's wait, and when.
        self._ka_outlived: Dict[str, float] = {}
        #: On a decode-mode manager: the prefills' ``HB:`` notifications
        #: drained from the agent (see :meth:`_drain_notifications`).
        self.heartbeats_drained = 0
        if disaggregation_mode != DisaggregationMode.PREFILL:
            self._ka_ready.set()
            super().__init__(args, disaggregation_mode, server_args, is_mla_backend, **kwargs)
            if disaggregation_mode == DisaggregationMode.DECODE and drain_every is not None:
                threading.Thread(target=self._drain_notifications, args=(float(drain_every),),
                                 name="nixl-keepalive-drain", daemon=True).start()
            return
        check_sglang_version()
        # A refused knob stops here, before SGLang's manager starts its
        # threads or makes its agent.
        config = nixl_keepalive.Config(**(keepalive or {}))
        api = sys.modules.get("nixl._api")
        if api is None:
            import nixl._api as api  # type: ignore  # what NixlKVManager imports
        with _agent_record_lock:
            recorder = _RecordingAgentClass(api.nixl_agent)
            api.nixl_agent = recorder
            try:
                # Starts SGLang's transfer workers and bootstrap thread; a
                # decode that registers before the service exists waits in
                # _add_remote_peer for _ka_ready.
                super().__init__(args, disaggregation_mode, server_args, is_mla_backend, **kwargs)
            except BaseException:
                self._ka_ready.set()
                raise
            finally:
                api.nixl_agent = recorder.real
        real = self.agent
        conf = next((c for a, c in recorder.made if a is real), None)
        try:
            self._ka = Keepalive(real, config, agent_config=conf, control=control)
            self.agent = _GuardedAgent(real, self)
        finally:
            self._ka_ready.set()
        logger.info("nixl_keepalive: keepalive service on SGLang's prefill agent %s (%s)",
                    real.name, self._ka.config)

    # -- what the service knows -------------------------------------------

    @property
    def keepalive(self) -> Optional[Keepalive]:
        """The service (``None`` on a decode-mode manager)."""
        return self._ka

    @property
    def released_decodes(self) -> List[str]:
        """The decodes' agent names the service released, oldest first."""
        with self._ka_lock:
            return list(self._ka_released)

    def wait_decode_released(self, agent_name: str, timeout: Optional[float] = None) -> bool:
        """Waits until the service released decode ``agent_name`` and its
        tables are gone from this manager; ``False`` on timeout, or when the
        service never registered it."""
        with self._ka_lock:
            dropped = self._ka_dropped.get(agent_name)
        return dropped is not None and dropped.wait(timeout)

    def _ka_engine_of_agent(self, name: Any) -> Any:
        key = name.decode() if isinstance(name, bytes) else str(name)
        with self._ka_lock:
            return self._ka_by_agent.get(key)

    def _ka_engine_of_dlist(self, handle: Any) -> Any:
        with self._ka_lock:
            return self._ka_by_dlist.get(_dlist_key(handle))

    def _ka_adopt_dlist(self, agent_name: Any, handle: Any) -> None:
        """A dlist prepped for a registered decode after its registration:
        its writes are that decode's (guarded as its others)."""
        name = agent_name.decode() if isinstance(agent_name, bytes) else str(agent_name)
        with self._ka_lock:
            engine = self._ka_by_agent.get(name)
            if engine is not None:
                self._ka_by_dlist[_dlist_key(handle)] = engine
                self._ka_stale.pop(_dlist_key(handle), None)

    def _ka_why_unknown(self, kind: str, key: Any) -> str:
        """Why no registered decode holds this ``dlist`` (by its key) or
        ``agent`` (by name), as far as this manager knows."""
        with self._ka_lock:
            if kind == "dlist":
                gone = self._ka_stale.get(key)
            else:
                gone = key if key in self._ka_released else None
        if gone is not None:
            return f"decode {gone} was released"
        return "not a dlist or agent of a decode the service registered"

    def _ka_dlists(self, name: str) -> List[Any]:
        """The dlists SGLang prepped for decode ``name`` (released with it)."""
        handles = []
        if name in self.prep_handles:
            handles.append(self.prep_handles[name])
        slice_dst = self.prep_handles_slice_dst.get(name)
        if slice_dst is not None:
            handles.append(slice_dst[0])
        return handles

    # -- SGLang's hooks ----------------------------------------------------

    def _add_remote_peer(self, decode_kv_args: Any) -> None:
        self._ka_ready.wait()
        ka = self._ka
        name = decode_kv_args.agent_name
        if ka is None or ka.closed or name in self.decode_kv_args_table:
            return super()._add_remote_peer(decode_kv_args)
        address = _peer_address(decode_kv_args.endpoint, decode_kv_args.dst_port)
        loads_as = nixl_keepalive.parse_agent_name(decode_kv_args.agent_metadata)
        if loads_as != name:
            # SGLang keys its tables by the registration's agent-name frame,
            # NIXL loads the metadata under the name inside it: a mismatch
            # would load an agent no table (and no release) knows.
            with self._ka_lock:
                self.refused_registrations += 1
            logger.error("nixl_keepalive: decode registration from %s refused: it names agent %r, its "
                         "metadata is agent %r (accepted: the same name in both)", address, name, loads_as)
            return
        engine = None
        for last_try in (False, True):
            holder = None
            # The address is the decode's own word: a live decode there is
            # not replaced on it (ka.handshake's declared=True).
            with ka.handshake(address, declared=True) as h:
                try:
                    # On SGLang's bootstrap thread; our watcher thread
                    # ends the given-up writes: no limit on the wait.
                    engine = h.ready_to_load(name, [name], timeout=None)
                except nixl_keepalive.IdentityConflict as e:
                    if e.conflict != "address_in_use" or last_try:
                        # Refused before anything is loaded; the registered
                        # engine is kept. The decode's rooms fail at its own
                        # timeout.
                        self._ka_refused(name, address, str(e))
                        return
                    holder, wait = e.holder, _declared_wait(ka.config)
                    with self._ka_lock:
                        self.declared_conflicts += 1
                    logger.warning("nixl_keepalive: decode %s declares %s, where decode %s is live: not a "
                                   "replacement on its word; %s was heartbeated, waiting up to %.2f s for its fate",
                                   name, address, holder, holder, wait)
                if holder is None and engine is None:
                    super()._add_remote_peer(decode_kv_args)
                    dlists = self._ka_dlists(name)
                    try:
                        engine = h.register(dlists)
                    except nixl_keepalive.RegistrationRefused as e:
                        logger.error("nixl_keepalive: decode %s at %s not registered (%s); giving it back",
                                     name, address, e.reason)
                        self._ka_forget(name)
                        ka.give_back(e.registration)
                        return
            if holder is None:
                break
            # Out of the handshake (an open one at the address would hold
            # the holder's release back): the service heartbeated the
            # holder; a decode that is gone (a restart at the same address)
            # is released on that heartbeat's REMOTE_DISCONNECT, and this
            # registration is tried once more. A live one stays, and this
            # one is refused: two decodes declaring one address. A holder
            # that outlived a wait lately is not waited for again: a stream
            # of declarations (a hostile peer on the bootstrap port) must
            # not keep SGLang's bootstrap thread waiting.
            with self._ka_lock:
                outlived = self._ka_outlived.get(holder)
            if outlived is not None and time.monotonic() - outlived < _DECLARED_REWAIT_S:
                self._ka_refused(name, address, f"decode {holder} is live at that address (it outlived a wait "
                                 f"{time.monotonic() - outlived:.1f} s ago; accepted: a decode's own address, or "
                                 "one whose holder is gone)")
                return
            with self._ka_lock:
                self.declared_waits += 1
            if not self.wait_decode_released(holder, wait):
                with self._ka_lock:
                    self._ka_outlived[holder] = time.monotonic()
                self._ka_refused(name, address, f"decode {holder} is live at that address and was not found "
                                 f"gone within {wait:.2f} s (two decodes declaring one "
                                 "address; accepted: a decode's own address, or one whose holder is gone)")
                return
        with self._ka_lock:
            self._ka_by_agent[name] = engine
            self._ka_dropped[name] = threading.Event()
            for handle in self._ka_dlists(name):
                self._ka_by_dlist[_dlist_key(handle)] = engine
        engine.on_released(self._ka_on_released)

    def _ka_on_released(self, engine: Any) -> None:
        # On the service's thread, after its NIXL calls: dict operations only.
        name = engine.id
        self._ka_forget(name)
        with self._ka_lock:
            if self._ka_by_agent.get(name) is engine:
                del self._ka_by_agent[name]
            for handle in [h for h, e in self._ka_by_dlist.items() if e is engine]:
                del self._ka_by_dlist[handle]
                self._ka_stale[handle] = name
            while len(self._ka_stale) > _STALE_KEPT:  # the oldest said less precisely
                del self._ka_stale[next(iter(self._ka_stale))]
            self._ka_released.append(name)
            self._ka_outlived.pop(name, None)
            dropped = self._ka_dropped.get(name)
        if dropped is not None:
            dropped.set()
        logger.info("nixl_keepalive: decode %s released; its tables dropped", name)

    def _ka_refused(self, name: str, address: str, why: str) -> None:
        with self._ka_lock:
            self.refused_registrations += 1
        logger.error("nixl_keepalive: decode %s at %s refused: %s", name, address, why)

    def _ka_forget(self, name: str) -> None:
        agent = getattr(self, "agent", None)
        if isinstance(agent, _GuardedAgent):
            with agent._guards_lock:
                agent._failing.discard(name)  # a new registration starts afresh
        self.decode_kv_args_table.pop(name, None)
        self.prep_handles.pop(name, None)
        self.prep_handles_slice_dst.pop(name, None)
        self._prepared_state_plans.pop(name, None)
        self._peer_reload_times.pop(name, None)

    def _await_handles(self, handles: List[Any], *, failure_seen: bool) -> Any:
        settled, any_failed = super()._await_handles(handles, failure_seen=failure_seen)
        agent = self.agent
        if not settled and isinstance(agent, _GuardedAgent):
            # SGLang stops waiting; NIXL may still run these writes.
            n = agent.give_up_open(handles, GiveUp.TIMED_OUT)
            if n:
                logger.warning("nixl_keepalive: %d write(s) given up unsettled; NIXL may still read "
                               "their source pages", n)
        return settled, any_failed

    def _reload_invalidated_peers(self, room_transfer_infos: Dict[str, Any]) -> None:
        if self._ka is None:
            return super()._reload_invalidated_peers(room_transfer_infos)
        keep = {}
        for name, info in room_transfer_infos.items():
            engine = self._ka_engine_of_agent(name)
            if engine is not None and engine.is_live:
                keep[name] = info
            else:
                logger.info("nixl_keepalive: not reloading decode %s (%s)", name,
                            "unknown to the service" if engine is None else engine.state)
        return super()._reload_invalidated_peers(keep)

    def _drain_notifications(self, every: float) -> None:
        # SGLang's decode tells rooms apart over ZMQ and never calls
        # get_new_notifs; NIXL keeps each notification until someone does.
        while True:
            time.sleep(every)
            try:
                waiting = self.agent.get_new_notifs()
            except Exception as e:  # the agent is gone (shutdown): stop
                logger.warning("nixl_keepalive: notification drain stops: %s", e)
                return
            self.heartbeats_drained += sum(
                1 for messages in waiting.values() for m in messages if bytes(m).startswith(b"HB:"))

    def close_keepalive(self) -> Dict[str, Any]:
        """Stops the service: every decode released as its writes end (at
        most ``shutdown_drain``); returns what ``Keepalive.close()`` says."""
        if self._ka is None:
            return {}
        return self._ka.close()
