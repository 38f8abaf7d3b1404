"""Every private name of vLLM's NIXL connector that ``nixl_keepalive.vllm``
relies on, in one place, with the vLLM releases it was checked on.

vLLM's NIXL connector has no extension API: the keepalive connector
subclasses vLLM's pull worker and overrides or calls its private methods,
and reads and writes its private tables. A vLLM release may rename or
reshape any of them without notice. So the connector does not trust a
version string: it checks, when it is built, that every name below is
there and that each method still takes the parameters it is called with.

- On a release in :data:`TESTED_VLLM` (CI runs the tier on each) the
  checks pass by test.
- On any other release the same checks run; if one fails the connector
  refuses to start, naming the missing name (a silent fallback to vLLM's
  own behaviour would hide a missing keepalive from the operator). If every
  check passes it starts with one WARNING naming the untested version:
  the names are there, but their meaning may have changed, which only the
  tier can tell.

Nothing here imports vLLM: the checks take the objects to look at.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Iterable, List, Optional, Tuple

TESTED_VLLM: Tuple[str, ...] = ("0.33", "0.34")
"""The vLLM release series the connector is tested on (CI runs the vLLM
tier on 0.33.0 and 0.34.0)."""

CHECKED_ON: Tuple[str, ...] = ("0.33.0", "0.34.0")
"""The vLLM releases every hook below was read and checked on."""


@dataclass(frozen=True)
class Hook:
    """One private name of vLLM's NIXL connector the keepalive relies on.

    ``where``: ``"worker"`` (a method or class attribute of
    ``NixlPullConnectorWorker``), ``"worker instance"`` (an attribute its
    constructor sets), ``"base_worker"`` (a global of the module
    ``kv_connector.v1.nixl.base_worker``), ``"connector"``
    (``NixlBaseConnector``), ``"scheduler"`` (a method of
    ``NixlPullConnectorScheduler``), ``"push_worker"`` (a method of
    ``NixlPushConnectorWorker``) or ``"push_worker instance"`` (an
    attribute its constructor sets). ``params``: for a method, the parameters after
    ``self`` as vLLM names them (the connector overrides it or calls it with
    these). ``use``: what the keepalive does with it."""

    where: str
    name: str
    params: Optional[Tuple[str, ...]] = None
    use: str = ""


READ_BLOCKS_PARAMS = (
    "read_spec", "dst_engine_id", "request_id", "remote_request_id", "local_xfer_side_handle",
    "local_dram_handle", "remote_xfer_side_handle", "expected_consumers", "awaiting_kvs",
)

PUSH_XFER_BLOCKS_PARAMS = (
    "read_spec", "dst_engine_id", "request_id", "remote_request_id", "local_xfer_side_handle",
    "remote_xfer_side_handle",
)

HOOKS: Tuple[Hook, ...] = (
    # Methods the connector overrides (vLLM calls them; ours run instead).
    Hook("worker", "_nixl_handshake",
         ("host", "port", "remote_tp_size", "expected_engine_id", "remote_dcp_size", "remote_pp_size",
          "notif_agents_only"),
         "the service's handshake protocol around vLLM's side channel"),
    Hook("worker", "add_remote_agent", ("nixl_agent_meta", "remote_tp_rank", "remote_tp_size", "remote_dcp_size"),
         "the metadata held until the service's claim, then loaded"),
    Hook("worker", "_track_remote_engine_replacement", ("engine_id", "host", "port"),
         "engines loaded without our handshake registered with the service"),
    Hook("worker", "_cleanup_remote_engine", ("engine_id", "log_eviction"),
         "vLLM's retirements handed to the service; vLLM's purge reused with the NIXL calls made harmless"),
    Hook("worker", "_send_heartbeats", ("metadata",), "vLLM's HB: request ids become the service's leases"),
    Hook("worker", "_log_failure", ("failure_type", "req_id", "msg", "error", "meta", "extra_context"),
         "the error NIXL raised when a READ is posted"),
    Hook("worker", "start_load_kv", ("metadata",), "each step: guards and released engines purged"),
    Hook("worker", "_read_blocks", READ_BLOCKS_PARAMS, "every READ posted under a read guard"),
    Hook("worker", "_pop_done_transfers", ("transfers",), "each READ ended with its raw NIXL status"),
    Hook("worker", "get_transfer_results", (), "each step: guards, purge, leases of finished requests"),
    Hook("worker", "shutdown", (), "the service closed before vLLM destroys the agent"),
    # Methods the connector calls.
    Hook("worker", "_ensure_handshake",
         ("engine_id", "host", "port", "tp_size", "dcp_size", "pp_size", "notif_agents_only"),
         "vLLM's proactive handshake for heartbeated engines"),
    Hook("worker", "_handle_failed_transfer", ("req_id", "handle", "failed_req_ids", "record_failed_transfer"),
         "a refused READ fails its request"),
    # Tables the connector reads or writes.
    Hook("worker instance", "nixl_wrapper", use="the agent the service runs over"),
    Hook("worker instance", "_remote_agents", use="the agents vLLM loaded per engine"),
    Hook("worker instance", "dst_xfer_side_handles", use="the dlist handles the service releases"),
    Hook("worker instance", "kv_caches_base_addr", use="what a refused registration leaves to drop"),
    Hook("worker instance", "_recving_transfers", use="READs vLLM polls, each given a guard"),
    Hook("worker instance", "_recving_metadata", use="a READ's engine and blocks"),
    Hook("worker instance", "_recv_failures", use="a refused READ's request failed"),
    Hook("worker instance", "_handshake_lock", use="vLLM's lock over its engine tables"),
    Hook("worker instance", "_handshake_futures", use="engines still handshaking are not purged"),
    Hook("worker instance", "_handshake_initiation_executor", use="stopped first at shutdown"),
    Hook("worker instance", "_engine_last_active", use="vLLM's TTL stamp kept current"),
    Hook("worker instance", "_hb_handshake_notif_only", use="vLLM's heartbeat handshake mode"),
    Hook("worker instance", "xfer_stats", use="failed and given-up READs counted as vLLM counts them"),
    Hook("worker instance", "tp_rank", use="the rank's control-endpoint port (control_addr)"),
    Hook("base_worker", "nixl_agent_config", use="the agent made with NIXL_THREAD_SYNC_RW"),
    Hook("connector", "__init__", ("vllm_config", "role", "kv_cache_config"),
         "NixlBaseConnector's constructor, then our worker"),
    # Push mode (nixl_keepalive.vllm_push, the prefill side): methods of
    # NixlPushConnectorWorker it overrides or calls. The base worker's
    # hooks above (_nixl_handshake, add_remote_agent, _cleanup_remote_engine,
    # _log_failure, _pop_done_transfers, _handle_failed_transfer, shutdown,
    # nixl_agent_config) are its too.
    Hook("push_worker", "_xfer_blocks_for_req", ("req_id", "meta"),
         "a WRITE to a decode that is not live refused before vLLM's tables are read"),
    Hook("push_worker", "_xfer_blocks", PUSH_XFER_BLOCKS_PARAMS, "every WRITE posted under a write guard"),
    Hook("push_worker", "get_transfer_results", (), "each step: released decodes dropped, WRITEs polled"),
    Hook("push_worker", "start_load_kv", ("metadata",), "each step: released decodes dropped"),
    Hook("push_worker", "shutdown", (), "the writer thread stopped, then the service, before the agent goes"),
    Hook("push_worker", "_pop_done_transfers", ("transfers",), "each WRITE ended with its raw NIXL status"),
    Hook("push_worker", "_handle_failed_transfer", ("req_id", "handle", "failed_req_ids", "record_failed_transfer"),
         "a failed WRITE's handle released as vLLM does"),
    # Tables the push connector reads or writes.
    Hook("push_worker instance", "nixl_wrapper", use="the agent the service runs over"),
    Hook("push_worker instance", "_remote_agents", use="the agents vLLM loaded per decode"),
    Hook("push_worker instance", "dst_xfer_side_handles", use="the decode's dlist handles the service releases"),
    Hook("push_worker instance", "_handshake_lock", use="vLLM's lock over its engine tables"),
    Hook("push_worker instance", "_handshake_futures", use="decodes still handshaking are not purged"),
    Hook("push_worker instance", "_handshake_initiation_executor", use="stopped first at shutdown"),
    Hook("push_worker instance", "_sending_transfers", use="the WRITEs vLLM polls"),
    Hook("push_worker instance", "_sending_transfers_lock", use="vLLM's lock over its WRITEs"),
    Hook("push_worker instance", "_send_failures", use="a refused WRITE's request failed"),
    Hook("push_worker instance", "_pending_d_registrations", use="a released decode's unmatched registrations"),
    Hook("push_worker instance", "_evict_finished_inbox", use="those registrations evicted by the writer"),
    Hook("push_worker instance", "_push_writer_wake", use="the writer woken for the eviction"),
    Hook("push_worker instance", "_push_writer_stop", use="the writer stopped first at shutdown"),
    Hook("push_worker instance", "_push_writer_thread", use="the writer joined at shutdown"),
    Hook("push_worker instance", "xfer_stats", use="refused WRITEs counted as vLLM counts failed ones"),
    # The scheduler side (NixlPullConnectorScheduler): a failed load's
    # blocks kept until its given-up READs are over.
    Hook("scheduler", "update_state_after_alloc", ("request", "blocks", "num_external_tokens"),
         "the loads started"),
    Hook("scheduler", "request_finished", ("request", "block_ids"), "the loads of finished requests"),
    Hook("scheduler", "update_connector_output", ("connector_output",),
         "a failed load's free withheld until the workers say its READs are over"),
    Hook("scheduler", "build_connector_meta", ("scheduler_output",),
         "the withheld requests announced to the workers"),
)
"""Every hook, checked on each release of :data:`CHECKED_ON`."""


def tested(version: Optional[str]) -> bool:
    """Whether ``version`` is in a release series of :data:`TESTED_VLLM`."""
    if version is None:
        return False
    return any(version == s or version.startswith(s + ".") for s in TESTED_VLLM)


def _params(fn: Any) -> Optional[Tuple[str, ...]]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    names = tuple(sig.parameters)
    return names[1:] if names and names[0] == "self" else names


def problems(where: str, obj: Any, hooks: Iterable[Hook] = HOOKS) -> List[str]:
    """What is wrong with ``obj`` (the worker class, a worker instance, the
    ``base_worker`` module or ``NixlBaseConnector``) for the hooks of kind
    ``where``: each missing name, and each method whose parameters differ,
    as a sentence naming both."""
    out = []
    for hook in hooks:
        if hook.where != where:
            continue
        if where.endswith(" instance"):
            present = hook.name in getattr(obj, "__dict__", {}) or hasattr(type(obj), hook.name)
        else:
            present = hasattr(obj, hook.name)
        if not present:
            out.append(f"{hook.where} {hook.name} is missing (used for: {hook.use})")
            continue
        if hook.params is None:
            continue
        found = _params(getattr(obj, hook.name))
        if found is not None and found != hook.params:
            out.append(
                f"{hook.where} {hook.name} takes ({', '.join(found)}), not ({', '.join(hook.params)}) "
                f"(used for: {hook.use})"
            )
    return out
