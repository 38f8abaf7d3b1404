"""What the pull and push connectors' workers share: the check of the
installed vLLM, the service made inside vLLM's worker constructor (the
agent made with NIXL's RW thread-sync mode), the status a polled transfer
ends with, the service's events logged, and the service stopped before
vLLM destroys the agent. A mixin (:class:`ServiceHooks`) of
:class:`nixl_keepalive.vllm.KeepaliveNixlConnectorWorker` and
:class:`nixl_keepalive.vllm_push.KeepaliveNixlPushConnectorWorker`, before
vLLM's worker in their bases; it needs no vLLM to import (the check
imports vLLM's connector when it runs).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import threading
from typing import Any, ClassVar, Dict, List, Optional, Set, Tuple

import nixl_keepalive
from nixl_keepalive import Keepalive, vllm_hooks
from nixl_keepalive.vllm_hooks import TESTED_VLLM
from nixl_keepalive.vllm_knobs import control_addr_of_rank

# The connector's one logger: every line of the pull connector, from any
# of its modules, under the name operators filter on (the push connector
# names its own in ServiceHooks._ka_log).
logger = logging.getLogger("nixl_keepalive.vllm")
_is_nixl_agent = nixl_keepalive._is_nixl_agent

_TESTED_TEXT = ", ".join(f"{s}.x" for s in TESTED_VLLM)


def _vllm_version() -> Optional[str]:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def _needs_vllm(module: str, what: str, where: str, e: ImportError) -> ImportError:
    """The ImportError of a connector module on a Python where vLLM's NIXL
    connector is missing, or laid out as no tested release lays it out."""
    found = _vllm_version()
    return ImportError(
        f"{module} needs vLLM's {what} (tested: {_TESTED_TEXT}; {where}); "
        f"{'vLLM is not installed' if found is None else 'found vLLM ' + found}: {e}"
    )


_untested_warned: Set[str] = set()


def check_vllm_version(version: Optional[str] = None) -> str:
    """Checks the installed vLLM's NIXL connector for every hook this
    module relies on (:mod:`nixl_keepalive.vllm_hooks`): raises
    ``RuntimeError`` naming each one missing or reshaped, with the version
    found and the tested ones. On a version outside the tested series
    (``version``, default the installed one) with every hook in place it
    logs one WARNING naming it. Returns the version."""
    found = _vllm_version() if version is None else version
    if found is None:
        raise RuntimeError(
            f"nixl_keepalive.vllm needs vLLM (tested: {_TESTED_TEXT}); vLLM is not installed"
        )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker

    wrong = (vllm_hooks.problems("worker", NixlPullConnectorWorker)
             + vllm_hooks.problems("base_worker", base_worker)
             + vllm_hooks.problems("connector", NixlBaseConnector)
             + vllm_hooks.problems("scheduler", NixlPullConnectorScheduler))
    if wrong:
        raise RuntimeError(
            f"nixl_keepalive.vllm cannot run on vLLM {found}: its NIXL connector lacks what the keepalive "
            f"relies on: {'; '.join(wrong)}. Tested on vLLM {_TESTED_TEXT}; use one of those, or vLLM's own "
            "NixlConnector without the keepalive."
        )
    if not vllm_hooks.tested(found) and found not in _untested_warned:
        _untested_warned.add(found)
        logger.warning(
            "nixl_keepalive.vllm: vLLM %s is not a tested release (tested: %s). Every hook the keepalive "
            "uses is present with the parameters it expects (%d checked), so it runs; what they do may "
            "have changed, which only the tier's tests on that release can tell.",
            found, _TESTED_TEXT, len(vllm_hooks.HOOKS))
    return found


# The agent vLLM makes: its config with the RW thread-sync mode. vLLM's
# worker builds `nixl_agent_config(...)` from base_worker's globals; while
# our worker's constructor runs (under this lock) that name returns the
# same config with `sync_mode` set. Nothing of vLLM's is edited.
_agent_config_lock = threading.Lock()


def _rw_sync_mode() -> Any:
    try:
        from nixl._api import nixl_thread_sync_t  # type: ignore
    except ImportError:  # pragma: no cover - vLLM imports the same module
        return None
    return nixl_thread_sync_t.NIXL_THREAD_SYNC_RW


def _takes(fn: Any, name: str) -> bool:
    """Whether ``fn`` takes a keyword argument ``name`` (``True`` when its
    signature cannot be read)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


class _RwAgentConfig:
    """Stands for base_worker's ``nixl_agent_config`` during our
    constructor: the same class, with ``sync_mode`` RW unless set."""

    def __init__(self, real: Any, sync_mode: Any) -> None:
        self._real = real
        # A stand-in that takes no sync_mode (vLLM 0.34's unit tests patch
        # nixl_agent_config with one) is called as vLLM calls it; the
        # service then sees the mode it was made with.
        self._sync_mode = sync_mode if _takes(real, "sync_mode") else None
        self.made: List[Any] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._sync_mode is not None and kwargs.get("sync_mode") is None:
            kwargs["sync_mode"] = self._sync_mode
        conf = self._real(*args, **kwargs)
        self.made.append(conf)
        return conf


class _WorkerAgent:
    """The agent a test double stands for, as the service sees it: each
    call goes to the worker's ``nixl_wrapper`` of the moment (vLLM's unit
    tests wrap it in a spy after the worker is built). Only for agents that
    are not NIXL's ``nixl_agent``."""

    __slots__ = ("_worker", "__weakref__")

    def __init__(self, worker: Any) -> None:
        import weakref

        self._worker = weakref.ref(worker)

    def _agent(self) -> Any:
        worker = self._worker()
        if worker is None:
            raise RuntimeError("the vLLM worker of this agent is gone")
        return worker.nixl_wrapper

    def send_notif(self, agent_name: Any, notif_msg: Any) -> Any:
        return self._agent().send_notif(agent_name, notif_msg=notif_msg)

    def release_dlist_handle(self, handle: Any) -> Any:
        return self._agent().release_dlist_handle(handle)

    def remove_remote_agent(self, agent_name: Any) -> Any:
        return self._agent().remove_remote_agent(agent_name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent(), name)


class ServiceHooks:
    """The service inside a vLLM worker, for both modes: what differs is
    said by the class attributes below, set by each worker."""

    #: vLLM's worker class the keepalive worker extends (its shutdown
    #: gives back a construction that was refused).
    _ka_vllm_worker: ClassVar[Any] = None
    #: The hooks kind of a built worker (``vllm_hooks``).
    _ka_hooks_kind: ClassVar[str] = "worker instance"
    #: The module that speaks in refusals and log lines.
    _ka_module: ClassVar[str] = "nixl_keepalive.vllm"
    #: The connector's logger.
    _ka_log: ClassVar[logging.Logger] = logger
    #: What the remote engines are in log lines ("engine", "decode").
    _ka_peer: ClassVar[str] = "engine"

    def _ka_construct(self, vllm_config: Any, engine_id: str, kv_cache_config: Any, ka_config: Any,
                      own: Dict[str, Any]) -> None:
        """vLLM's own constructor, with the agent made in the RW sync mode,
        then the service over that agent (``self._ka``; ``None`` where a
        test double of vLLM's unit tests cannot carry it, said loudly).
        Whatever is refused after vLLM's constructor ran gives back what
        it made first."""
        self._ka = None
        self._ka_closed: Optional[dict] = None
        self._ka_events: Any = None
        self._ka_failures: Dict[int, BaseException] = {}
        self._ka_local = threading.local()
        # Guards the service's registrations by engine id (_ka_engines)
        # between the handshake executor, vLLM's main thread and (push)
        # the writer thread; taken after vLLM's _handshake_lock.
        self._ka_lock = threading.RLock()
        self._ka_engines: Dict[str, Any] = {}
        self._ka_control = own["control_addr"]
        self._ka_control_token_file = own["control_token_file"]

        real_config = _base_worker_module().nixl_agent_config
        rw_config = _RwAgentConfig(real_config, _rw_sync_mode()) if real_config is not None else None
        with _agent_config_lock:
            base = _base_worker_module()
            if rw_config is not None:
                base.nixl_agent_config = rw_config
            try:
                super().__init__(vllm_config, engine_id, kv_cache_config)  # type: ignore[call-arg]
            finally:
                base.nixl_agent_config = real_config
        missing = vllm_hooks.problems(self._ka_hooks_kind, self)
        if missing:
            self._ka_undo_construction()
            what = "push worker" if self._ka_hooks_kind.startswith("push") else "NIXL worker"
            raise RuntimeError(
                f"{self._ka_module} cannot run on vLLM {_vllm_version()}: its {what} lacks what the "
                f"keepalive relies on: {'; '.join(missing)} (tested on vLLM {_TESTED_TEXT})"
            )

        agent = self.nixl_wrapper
        # The config the agent was made with (the last one vLLM built):
        # the service checks its sync mode and progress thread.
        agent_conf = rw_config.made[-1] if rw_config is not None and rw_config.made else None
        # NIXL's own agent is handed to the service as is (it calls the
        # native agent). A test double (vLLM's unit tests' fake, which they
        # may swap for a spy after construction) is reached through the
        # worker: the service then calls whatever `nixl_wrapper` is.
        service_agent = agent if _is_nixl_agent(agent) else _WorkerAgent(self)
        control = None
        if self._ka_control is not None:
            # One port per rank: a router reaches every rank of the engine.
            control = {"addr": control_addr_of_rank(self._ka_control, int(getattr(self, "tp_rank", 0) or 0))}
            if self._ka_control_token_file is not None:
                control["token_file"] = self._ka_control_token_file
        try:
            self._ka = Keepalive(service_agent, ka_config, agent_config=agent_conf, control=control)
        except Exception as e:
            if _is_nixl_agent(agent) or control is not None:
                self._ka_undo_construction()
                raise
            # A test double of vLLM's own unit tests, which the service
            # cannot run over: vLLM's behaviour, said loudly.
            self._ka_log.warning(
                "%s: the keepalive is OFF for this worker: its agent %r is not NIXL's nixl_agent and the "
                "service refused it (%s: %s)", self._ka_module, type(agent).__name__, type(e).__name__, e)
            self._ka = None
        if self._ka is not None:
            self._ka_events = self._ka.events()

    def _ka_undo_construction(self) -> None:
        """A construction refused after vLLM's own ran: what vLLM made (its
        agent, its threads) given back before the refusal propagates."""
        self._ka = None
        try:
            self._ka_vllm_worker.shutdown(self)
        except Exception:  # noqa: BLE001 - the refusal being raised says what matters
            self._ka_log.debug("vLLM's shutdown after the refused construction failed", exc_info=True)

    def _ka_on(self) -> bool:
        ka = getattr(self, "_ka", None)
        return ka is not None and getattr(self, "_ka_closed", None) is None

    def keepalive(self) -> Optional[Keepalive]:
        """The service (``None`` when off)."""
        return getattr(self, "_ka", None)

    def _ka_raw_status(self, handle: Any) -> Any:
        """The transfer's raw status (an int), or the exception asking for
        it raised; for a test double, its check_xfer_state mapped."""
        return nixl_keepalive._raw_status(self.nixl_wrapper, handle)

    def _ka_poll_guarded(self, transfers: Dict[str, List[Any]],
                         guarded: Dict[Any, Any]) -> Tuple[Set[str], Dict[str, List[Any]]]:
        """One pass over vLLM's transfers in flight (``transfers``, handles
        by request): each one the service guards (``guarded``, by handle;
        its entry's ``guard``) ends with its raw status once it is no longer
        in progress (:meth:`_ka_transfer_ended`), and while it is, is left
        to :meth:`_ka_running`; the others (posted by other code) are polled
        by vLLM's own ``_pop_done_transfers``. Returns the failed requests
        and what stays in flight of each request (empty: none)."""
        failed: Set[str] = set()
        untracked: Dict[str, List[Any]] = {}
        remaining: Dict[str, List[Any]] = {}
        for req_id, handles in list(transfers.items()):
            left = remaining.setdefault(req_id, [])
            for handle in handles:
                with self._ka_lock:
                    entry = guarded.get(handle)
                if entry is None:
                    untracked.setdefault(req_id, []).append(handle)
                    continue
                status = self._ka_raw_status(handle)
                if isinstance(status, int) and status == nixl_keepalive.IN_PROG:
                    if self._ka_running(req_id, handle, entry, failed):
                        left.append(handle)
                    continue
                with self._ka_lock:
                    del guarded[handle]
                if self._ka_transfer_ended(req_id, handle, entry.guard, status, failed):
                    left.append(handle)
                    self._ka_kept_ended(handle)
        if untracked:
            _, u_failed = super()._pop_done_transfers(untracked)  # type: ignore[misc]
            failed |= u_failed
            for req_id, handles in untracked.items():
                remaining[req_id] += handles
        return failed, remaining

    def _ka_running(self, req_id: str, handle: Any, entry: Any, failed: Set[str]) -> bool:
        """A guarded transfer still in progress: True to go on polling it
        (the pull worker gives a READ up here)."""
        return True

    def _ka_kept_ended(self, handle: Any) -> None:
        """A guarded transfer that ended but whose handle vLLM keeps (its
        release failed): the pull worker never guards it again."""

    def _ka_transfer_ended(self, req_id: str, handle: Any, guard: Any, status: Any, failed: Set[str]) -> bool:
        """A polled transfer no longer in progress: its guard ends with its
        raw status (never check_xfer_state's "ERR"; an exception that is
        not NIXL's ends it without one), vLLM's stats and failure handling
        as vLLM does them. True when vLLM keeps the handle (its failure
        handling did not take it)."""
        if isinstance(status, int) and status == nixl_keepalive.SUCCESS:
            guard.finish(nixl_keepalive.SUCCESS)
            try:
                self.xfer_stats.record_transfer(self.nixl_wrapper.get_xfer_telemetry(handle))
                self.nixl_wrapper.release_xfer_handle(handle)
            except Exception as e:  # noqa: BLE001 - as vLLM handles it
                self._log_failure("transfer_exception", req_id, error=e)
                return not self._handle_failed_transfer(req_id, handle, failed)
            return False
        nixl_keepalive._end_transfer_guard(guard, status)
        name = nixl_keepalive.status_name(status) if isinstance(status, int) else type(status).__name__
        self._log_failure("transfer_failed", req_id, xfer_state=name,
                          error=status if isinstance(status, BaseException) else None)
        return not self._handle_failed_transfer(req_id, handle, failed)

    def _log_failure(self, failure_type: str, req_id: Optional[str], msg: str = "",
                     error: Optional[BaseException] = None, meta: Any = None, **extra_context: Any) -> None:
        # vLLM's transfer calls catch what NIXL raised and log it here: the
        # transfer's guard ends with that exception (REMOTE_DISCONNECT marks).
        failures = getattr(self, "_ka_failures", None)
        if error is not None and failures is not None:
            failures[threading.get_ident()] = error
        return super()._log_failure(failure_type, req_id, msg, error, meta, **extra_context)  # type: ignore[misc]

    def _ka_forgot(self, engine_id: str) -> None:
        """What the worker keeps of ``engine_id`` besides vLLM's tables,
        dropped with them (the pull worker's leases); nothing here."""

    def _ka_log_events(self) -> None:
        """The service's events since the last step, logged in the one
        line every surface prints them in."""
        events = self._ka_events
        while events is not None:
            try:
                got = events.get_line_nowait()
            except nixl_keepalive.ServiceStopped:
                break
            if got is None:
                break
            e, line = got
            kind = e.get("kind")
            level = logging.INFO if kind in ("registered", "released", "replaced", "retiring") else logging.WARNING
            self._ka_log.log(level, "nixl_keepalive: event: %s", line)

    def _ka_close_service(self, ka: Keepalive) -> None:
        """Stops the service while the agent is whole: it drains and
        releases every engine it holds; what it could not release is given
        back, and the engines leave vLLM's tables without a second NIXL
        call."""
        left = ka.close()
        self._ka_closed = left
        for registration in left.get("unreleased", []):
            try:
                ka.give_back(registration)
            except Exception:  # noqa: BLE001
                self._ka_log.warning("give_back at shutdown failed", exc_info=True)
        try:
            # A release's endpoint closes finish in UCX's next progress.
            self.nixl_wrapper.get_new_notifs()
        except Exception:  # noqa: BLE001
            pass
        with self._ka_lock:
            engines = list(self._ka_engines)
            self._ka_engines.clear()
        for eid in engines:
            if eid in self._remote_agents:
                self._ka_forget_tables(eid)


def _base_worker_module() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    return base_worker
