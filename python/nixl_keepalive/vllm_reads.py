"""What the pull connector's worker adapts of vLLM's reads
(``_read_blocks``, ``_pop_done_transfers``, ``get_transfer_results``,
``start_load_kv``): every READ runs under a read guard with its request's
lease and ends with the transfer's raw status (``REMOTE_DISCONNECT`` marks
the engine); a READ that times out or that the service failed is given up,
its request reported failed and its blocks held while the READ is polled
to its end (``docs/design/given-up-transfers.md``); a READ posted by other
code is adopted before anything may release its engine. A mixin of
:class:`nixl_keepalive.vllm.KeepaliveNixlConnectorWorker`; it needs no
vLLM to import.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Set, Tuple

import nixl_keepalive

# The connector's one logger: every line of the pull connector, from any
# of its modules, under the name operators filter on.
logger = logging.getLogger("nixl_keepalive.vllm")


@dataclass
class _Tracked:
    """A READ vLLM posted, under its read guard."""

    read: Any
    engine: Any
    req_id: str
    started: float = field(default_factory=time.monotonic)

    @property
    def guard(self) -> Any:
        return self.read


@dataclass
class _Held:
    """A request with given-up READs still running (its blocks stay
    allocated until every one ended)."""

    given_up: List[Any]
    engine_id: str
    blocks: int = 0
    since: float = field(default_factory=time.monotonic)


@dataclass
class _Fenced:
    """A given-up READ's handle, kept (not released: that does not end the
    transfer) and polled to its end."""

    given_up: Any
    req_id: str


class ReadHooks:
    """vLLM's reads, under the service's read guards."""

    def held_requests(self) -> Dict[str, Dict[str, Any]]:
        """Requests whose blocks are held because a read of theirs was given
        up and may still run: per request id, its engine, the reasons, the
        destinations so far (``None``: the READ is still running), its
        blocks, and since when (``time.monotonic()``)."""
        out = {}
        for req_id, h in getattr(self, "_ka_held", {}).items():
            out[req_id] = {
                "engine": h.engine_id,
                "why": [g.why for g in h.given_up],
                "destinations": [g.try_destination() for g in h.given_up],
                "blocks": h.blocks,
                "since": h.since,
            }
        return out

    def held_blocks(self) -> int:
        """The KV blocks held by given-up READs still running."""
        return sum(h.blocks for h in getattr(self, "_ka_held", {}).values())

    def _ka_guard_untracked(self) -> None:
        """Every transfer vLLM holds in flight (``_recving_transfers``) from
        an engine the service holds runs under a read guard, so the service
        never releases an engine under a READ vLLM still polls. Those posted
        by our ``_read_blocks`` have one already; this covers any other
        (a subclass's own posting, vLLM's unit tests' injected handles).
        Called before anything that may release an engine (a registration
        that replaces one) and each step."""
        if not self._ka_on():
            return
        with self._ka_reads_lock:
            if self._ka_ended:
                present = {h for hs in list(self._recving_transfers.values()) for h in list(hs)}
                self._ka_ended &= present
            for req_id, handles in list(self._recving_transfers.items()):
                remote = getattr(self._recving_metadata.get(req_id), "remote", None)
                engine = self._ka_engines.get(remote.engine_id) if remote is not None else None
                if engine is None:
                    continue
                for handle in list(handles):
                    if handle in self._ka_reads or handle in self._ka_ended:
                        continue
                    try:
                        # Already posted: adopted even on a marked engine,
                        # whose release then waits for it as for any read.
                        read = engine.adopt_posted_read()
                    except nixl_keepalive.ReadRefused as refused:
                        # Released before this pass saw the READ (it was
                        # posted after the last pass, by code that bypassed
                        # our _read_blocks): nothing can hold that release
                        # any more. Said loudly; vLLM polls it as it does.
                        self._ka_ended.add(handle)
                        self._ka_unguarded += 1
                        logger.error(
                            "nixl_keepalive.vllm: request %s's READ from engine %s was posted without a read guard "
                            "and found after the engine was %s: its transfer ran on released state (posted by "
                            "code other than this connector's _read_blocks)", req_id, engine.id, refused.state)
                        continue
                    self._ka_reads[handle] = _Tracked(read, engine, req_id)

    def start_load_kv(self, metadata: Any) -> None:
        wanted = getattr(metadata, "ka_free_when_over", None)
        if wanted and hasattr(self, "_ka_over_wanted"):  # built without our __init__ in vLLM's unit tests
            self._ka_over_wanted |= set(wanted)
        self._ka_guard_untracked()
        self._ka_process_releases()
        return super().start_load_kv(metadata)

    def _read_blocks(self, read_spec: Any, dst_engine_id: str, request_id: str, remote_request_id: str,
                     local_xfer_side_handle: Any, local_dram_handle: Any, remote_xfer_side_handle: Any,
                     expected_consumers: int, awaiting_kvs: bool) -> bool:
        args = dict(read_spec=read_spec, dst_engine_id=dst_engine_id, request_id=request_id,
                    remote_request_id=remote_request_id, local_xfer_side_handle=local_xfer_side_handle,
                    local_dram_handle=local_dram_handle, remote_xfer_side_handle=remote_xfer_side_handle,
                    expected_consumers=expected_consumers, awaiting_kvs=awaiting_kvs)
        engine = self._ka_engines.get(dst_engine_id) if self._ka_on() else None
        notify_only = not any(len(group) > 0 for group in read_spec.local_block_ids)
        if engine is None and self._ka_on() and not notify_only:
            # Not in this worker's table: the service may still hold a
            # registration of it (then the READ is guarded, or refused on a
            # marked engine); otherwise it is vLLM's own engine (loaded
            # outside the service, or refused by it), released by vLLM's
            # own rules, which wait for its READs.
            engine = self._ka.engine(dst_engine_id)
            if engine is None and dst_engine_id not in self._ka_own_engines:
                self._ka_own_engines.add(dst_engine_id)
                logger.warning(
                    "nixl_keepalive.vllm: READs from engine %s are vLLM's own: the keepalive holds no "
                    "registration of it (it was loaded outside the service's handshake or refused by it), so "
                    "they carry no read guard and vLLM's own cleanup releases it", dst_engine_id)
        if engine is None or notify_only:
            return super()._read_blocks(**args)
        try:
            read = engine.read()
        except nixl_keepalive.ReadRefused as refused:
            # The engine is dead, stalled, replaced or gone: fail the
            # request now (vLLM's load-failure policy decides), no READ.
            self._log_failure("transfer_refused_by_keepalive", request_id,
                              msg=f"engine {dst_engine_id} is {refused.state}", dst_engine_id=dst_engine_id)
            self.xfer_stats.record_failed_transfer()
            self._handle_failed_transfer(request_id, None, self._recv_failures, record_failed_transfer=False)
            return False
        self._ka_add_lease(engine, remote_request_id, "read:" + request_id)
        # Under the lock: the handshake thread's _ka_guard_untracked must
        # not see this handle posted before its guard is recorded.
        with self._ka_reads_lock:
            before = list(self._recving_transfers.get(request_id, ()))
            self._ka_failures.pop(threading.get_ident(), None)
            try:
                ok = super()._read_blocks(**args)
            except BaseException:
                read.close()
                raise
            new = [h for h in self._recving_transfers.get(request_id, ()) if not any(h is b for b in before)]
            error = self._ka_failures.pop(threading.get_ident(), None)
            if not new:
                # No transfer was left posted: the read ends with what NIXL
                # raised (REMOTE_DISCONNECT marks the engine).
                nixl_keepalive._end_transfer_guard(read, error)
                if not ok:
                    self._ka_drop_lease(dst_engine_id, remote_request_id, "read:" + request_id)
                return ok
            self._ka_reads[new[0]] = _Tracked(read, engine, request_id)
            for extra in new[1:]:  # a split DRAM/device read: one guard each
                try:
                    self._ka_reads[extra] = _Tracked(engine.read(), engine, request_id)
                except nixl_keepalive.ReadRefused:
                    pass  # polled as vLLM does
            return ok

    def _pop_done_transfers(self, transfers: Dict[str, List[Any]]) -> Tuple[Set[str], Set[str]]:
        if not self._ka_on() and not getattr(self, "_ka_reads", None):
            return super()._pop_done_transfers(transfers)
        with self._ka_reads_lock:
            return self._ka_pop_done_transfers(transfers)

    def _ka_pop_done_transfers(self, transfers: Dict[str, List[Any]]) -> Tuple[Set[str], Set[str]]:
        failed, remaining = self._ka_poll_guarded(transfers, self._ka_reads)
        done: Set[str] = set()
        self._ka_poll_fenced()
        for req_id, left in remaining.items():
            if left:
                transfers[req_id] = left
                continue
            if req_id in self._ka_held and not self._ka_report_at_once:
                # "recompute": vLLM would hand the blocks to the retry at
                # once: reported when the READs are over.
                transfers[req_id] = []
                failed.add(req_id)
                continue
            if req_id in self._ka_held:
                failed.add(req_id)
            done.add(req_id)
            del transfers[req_id]
        return done, failed

    def _ka_running(self, req_id: str, handle: Any, t: Any, failed: Set[str]) -> bool:
        """A READ still in progress: polled on, or given up (timed out, or
        its engine failed by the service): its request fails now, its
        blocks are held, the READ is kept and polled to its end."""
        now = time.monotonic()
        why = None
        if t.read.failed:
            why = nixl_keepalive.GiveUp.CANCELLED
        elif self._ka_read_timeout is not None and now - t.started >= self._ka_read_timeout:
            why = nixl_keepalive.GiveUp.TIMED_OUT
        if why is None:
            return True
        self._log_failure("transfer_given_up", req_id,
                          msg=f"read given up ({why}) after {now - t.started:.1f} s; the request "
                              "fails, its blocks are held until the READ ends",
                          dst_engine_id=t.engine.id)
        del self._ka_reads[handle]
        meta = self._recving_metadata.get(req_id)
        blocks = sum(len(g) for g in meta.local_block_ids) if meta is not None else 0
        # Kept, not released: releasing does not end a READ in progress
        # (its bytes still land when the prefill resumes), it only hides its
        # end. Polled to its end.
        given_up = t.read.give_up(why, blocks)
        self._ka_fenced[handle] = _Fenced(given_up, req_id)
        self._ka_drop_read_leases(req_id)  # P may free them: we will not read them
        self.xfer_stats.record_failed_transfer()
        held = self._ka_held.get(req_id)
        if held is None:
            self._ka_held[req_id] = _Held([given_up], t.engine.id, blocks)
        else:
            held.given_up.append(given_up)
            held.blocks = max(held.blocks, blocks)
        failed.add(req_id)
        return False

    def _ka_kept_ended(self, handle: Any) -> None:
        self._ka_ended.add(handle)

    def _ka_poll_fenced(self) -> None:
        """Polls the given-up READs: one that stopped being in progress
        ended (the prefill resumed or died): the service hears it (the
        engine may be released now), its handle is released, and a request
        whose READs all ended has its blocks back."""
        for handle, f in list(getattr(self, "_ka_fenced", {}).items()):
            status = self._ka_raw_status(handle)
            if isinstance(status, int) and status == nixl_keepalive.IN_PROG:
                continue
            del self._ka_fenced[handle]
            f.given_up.ended(status if not isinstance(status, BaseException) else nixl_keepalive.BACKEND)
            try:
                self.nixl_wrapper.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001 - an ended transfer's handle; logged
                logger.warning("release_xfer_handle of an ended given-up READ failed", exc_info=True)
            if not any(o.req_id == f.req_id for o in self._ka_fenced.values()):
                held = self._ka_held.pop(f.req_id, None)
                if held is not None:
                    logger.info("nixl_keepalive.vllm: request %s's given-up READs from engine %s ended after "
                                "%.1f s: its %d block(s) are free again", f.req_id, held.engine_id,
                                time.monotonic() - held.since, held.blocks)
                if not self._ka_report_at_once:
                    # Held back from the scheduler until now ("recompute").
                    transfers = self._recving_transfers
                    if f.req_id in transfers and not transfers[f.req_id]:
                        del transfers[f.req_id]
                        self._recv_failures.add(f.req_id)

    def _ka_over(self, results: Any) -> Any:
        """Adds to ``finished_sending`` every request the scheduler keeps
        the blocks of (``ka_free_when_over``) whose given-up READs on this
        worker are over: the scheduler frees its blocks once every worker
        said so."""
        over = {r for r in getattr(self, "_ka_over_wanted", ()) if r not in self._ka_held}
        if over:
            self._ka_over_wanted -= over
            sending = set(results.finished_sending or ())
            sending |= over
            results.finished_sending = sending
        return results

    def _ka_drop_read_leases(self, req_id: str) -> None:
        for key in [k for k, r in self._ka_leases.items() if ("read:" + req_id) in r]:
            self._ka_drop_lease(key[0], key[1], "read:" + req_id)

    def get_transfer_results(self) -> Any:
        if not self._ka_on():
            return super().get_transfer_results()
        self._ka_guard_untracked()
        self._ka_process_releases()
        results = super().get_transfer_results()
        for req_id in set(results.finished_recving or ()) | set(getattr(results, "failed_recving", ()) or ()):
            self._ka_drop_read_leases(req_id)
        return self._ka_over(results)
