"""One SGLang 0.5.23 disaggregation rank as a process, driven over stdin.

``python peer.py prefill|decode`` publishes SGLang's config for that role
(sglang_env.py), then answers one JSON command per stdin line with one JSON
line on stdout (SGLang's and NIXL's logs go to stderr). Everything that
moves KV is SGLang's own code: the prefill runs SGLang's bootstrap server,
the NIXL manager SGLang's scheduler would build (its plugins loaded, then
``get_kv_class``: SGLang's ``NixlKVManager``, or with ``"keepalive": true``,
which turns on our plugin's switch, nixl_keepalive's
``KeepaliveNixlKVManager``) and a ``NixlKVSender`` per room; the decode the
same manager lookup and a ``NixlKVReceiver`` per room, as SGLang's
schedulers drive them. The test (test_sglang_real.py) kills these processes for real.

Commands (``{"cmd": ..., ...}``), each answered ``{"ok": true, ...}`` or
``{"ok": false, "error": ...}``:

- both: ``start`` (``bootstrap_port``, ``keepalive``; prefill: ``knobs``)
  -> ``agent``, ``rank_port``, ``manager`` (the class built), ``pid``
- prefill: ``room`` (``room``, ``pages``, ``aux``) fills the room's source
  pages and makes its sender; ``bootstrapped`` (``room``, ``within``) waits
  until the decode's metadata for it arrived; ``send`` (``room``,
  ``within``) sends it and waits for the sender's end (``status``:
  ``success`` or ``failed``, ``failure``); ``state`` (``decode``) what the
  manager and the agent hold for a decode; ``wait_released`` (``decode``,
  ``within``); ``reload`` (``decode``) calls SGLang's
  ``_reload_invalidated_peers`` for it, as its transfer worker does after a
  failed room
- decode: ``room`` (``room``, ``pages``, ``src_pages``, ``aux``, ``prefill``)
  makes the receiver and sends the room's metadata; ``wait`` (``room``,
  ``within``) -> ``status`` and ``verified`` (every page holds the
  prefill's bytes for that room and source page); ``notifs``: the NIXL
  notifications waiting in the agent, which SGLang's decode never reads
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Dict

if os.environ.get("NIXL_KEEPALIVE_IMPORT_FIRST", "1") == "1":
    import nixl_keepalive  # noqa: F401  (before the first nixl_agent: the endpoint-close shim)

import numpy as np

import sglang_env as env

POLL_S = 0.02
STATUS = {0: "failed", 1: "bootstrapping", 2: "waiting_for_input", 3: "transferring", 4: "success"}


def sglang_manager_class(keepalive: bool, knobs: Dict[str, Any]) -> Any:
    """The NIXL manager class SGLang's scheduler would build in this
    process: the plugins loaded as ``run_scheduler_process`` loads them
    (``sglang.srt.plugins.load_plugins``), then ``get_kv_class``. The
    keepalive is on through the operator's switch, its knobs through the
    ``NIXL_KEEPALIVE_*`` variables, as an SGLang deployment would set them."""
    if keepalive:
        os.environ["NIXL_KEEPALIVE_SGLANG"] = "1"
        for knob, value in knobs.items():
            os.environ[f"NIXL_KEEPALIVE_{knob.upper()}"] = str(value)
    else:
        os.environ.pop("NIXL_KEEPALIVE_SGLANG", None)
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    from sglang.srt.plugins import load_plugins

    load_plugins()
    return get_kv_class(TransferBackend.NIXL, KVClassType.MANAGER)


class Rank:
    """What both roles start with: SGLang's config published for the role,
    the DRAM buffers, and the manager SGLang's lookup gives."""

    def _start_manager(self, role: str, bootstrap_port: int, item: int, keepalive: bool,
                       knobs: Dict[str, Any]) -> Dict[str, Any]:
        self.server_args = env.publish(role, env.model_dir(Path(os.environ["SGLANG_TIER_MODEL"])), bootstrap_port)
        from sglang.srt.disaggregation.utils import DisaggregationMode

        self.item = item
        self.kv, self.aux = env.buffers(item)
        manager_class = sglang_manager_class(keepalive, knobs)
        mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
        self.manager = manager_class(env.kv_args(self.kv, self.aux), mode, self.server_args, False)
        return {"rank_port": self.manager.rank_port,
                "manager": f"{manager_class.__module__}.{manager_class.__qualname__}"}


class Prefill(Rank):
    def __init__(self) -> None:
        self.manager: Any = None
        self.real_agent: Any = None
        self.senders: Dict[int, Any] = {}
        self.pages: Dict[int, Any] = {}
        self.bootstrap = ""

    def start(self, bootstrap_port: int, keepalive: bool, knobs: Dict[str, Any], item: int = env.ITEM) -> Dict[str, Any]:
        from sglang.srt.disaggregation.nixl.conn import NixlKVBootstrapServer

        self.bootstrap_server = NixlKVBootstrapServer("127.0.0.1", bootstrap_port)
        self.bootstrap = f"127.0.0.1:{bootstrap_port}"
        started = self._start_manager("prefill", bootstrap_port, item, keepalive, knobs)
        agent = self.manager.agent
        self.real_agent = getattr(agent, "_real", agent)
        return {"agent": self.real_agent.name, **started}

    def room(self, room: int, pages: list, aux: int) -> Dict[str, Any]:
        from sglang.srt.disaggregation.nixl.conn import NixlKVSender

        for b, buf in enumerate(self.kv):
            for p in pages:
                buf[p * self.item:(p + 1) * self.item] = env.page_bytes(room, b, p, self.item)
        self.pages[room] = (np.array(pages, dtype=np.int32), aux)
        self.senders[room] = NixlKVSender(self.manager, self.bootstrap, room)
        return {}

    def bootstrapped(self, room: int, within: float) -> Dict[str, Any]:
        sender = self.senders[room]
        deadline = time.monotonic() + within
        while sender.poll() == 1 and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return {"status": STATUS[sender.poll()]}

    def send(self, room: int, within: float) -> Dict[str, Any]:
        sender = self.senders[room]
        pages, aux = self.pages[room]
        sender.init(len(pages), aux_index=aux)
        sender.send(pages)
        deadline = time.monotonic() + within
        while sender.poll() not in (0, 4) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        status = sender.poll()
        failure = None
        if status == 0:
            try:
                sender.failure_exception()
            except Exception as e:  # SGLang raises the room's failure as an exception
                failure = str(e)
        return {"status": STATUS[status], "failure": failure}

    def state(self, decode: str) -> Dict[str, Any]:
        m = self.manager
        out: Dict[str, Any] = {
            "in_table": decode in m.decode_kv_args_table,
            "prep_handles": decode in m.prep_handles,
            "metadata_loaded": bool(self.real_agent.check_remote_metadata(decode)),
            # SGLang's own record of reloading a peer NIXL dropped.
            "reloaded": decode in m._peer_reload_times,
        }
        ka = getattr(m, "keepalive", None)
        if ka is not None:
            snap = ka.snapshot()
            out["engines"] = {e["engine"]: {"state": e["state"], "reads_in_flight": e["reads_in_flight"],
                                            "last_heartbeat": e["last_heartbeat"]}
                              for e in snap["engines"]}
            out["released"] = m.released_decodes
            out["open_guards"] = m.agent.open_guards()
            out["given_up"] = m.agent.given_up
            out["given_up_ended"] = dict(m.agent.given_up_ended)
            out["refused_unguarded"] = m.agent.refused_unguarded
            out["refused_registrations"] = m.refused_registrations
            out["declared_conflicts"] = m.declared_conflicts
            out["declared_waits"] = m.declared_waits
        try:
            self.real_agent.send_notif(decode, b"probe")
            out["send_notif"] = "sent"
        except Exception as e:
            out["send_notif"] = type(e).__name__
        return out

    def keep_dlists(self, decode: str) -> Dict[str, Any]:
        """Keeps the dlists SGLang prepped for ``decode`` (and its own), as
        a stale reference would outlive the decode's release."""
        self.kept = (self.manager.prep_handles[""], self.manager.prep_handles[decode])
        return {}

    def write_kept(self) -> Dict[str, Any]:
        """A WRITE through SGLang's agent with the kept dlists."""
        local, remote = self.kept
        try:
            handle = self.manager.agent.make_prepped_xfer("WRITE", local, [0], remote, [0])
            out: Dict[str, Any] = {"posted": bool(handle)}
        except Exception as e:  # noqa: BLE001 - what was raised is the answer
            out = {"refused": type(e).__name__, "message": str(e)}
        out["refused_unguarded"] = self.manager.agent.refused_unguarded
        return out

    def wait_released(self, decode: str, within: float) -> Dict[str, Any]:
        released = self.manager.wait_decode_released(decode, within)
        return {"released": released, "at": time.monotonic()}

    def reload(self, decode: str) -> Dict[str, Any]:
        self.manager._reload_invalidated_peers({decode: None})
        return {"metadata_loaded": bool(self.real_agent.check_remote_metadata(decode)),
                "in_table": decode in self.manager.decode_kv_args_table}


class Decode(Rank):
    def __init__(self) -> None:
        self.heartbeats_seen = 0
        self.receivers: Dict[int, Any] = {}
        self.expect: Dict[int, Any] = {}

    def start(self, bootstrap_port: int, item: int = env.ITEM, keepalive: bool = False) -> Dict[str, Any]:
        # With the keepalive: the decode side of nixl_keepalive.sglang,
        # SGLang's manager draining the notifications SGLang never reads.
        started = self._start_manager("decode", bootstrap_port, item, keepalive, {})
        return {"agent": self.manager.agent.name, **started}

    def register_forged(self, prefill_rank_port: int, name: str) -> Dict[str, Any]:
        """Sends the prefill SGLang's own registration of this decode with
        the agent-name frame replaced by ``name`` (the metadata unchanged)."""
        message = self.manager.build_receiver_registration_message()
        assert message[4] == self.manager.agent.name.encode("ascii"), "SGLang's registration layout changed"
        message[4] = name.encode("ascii")
        return self._send_registration(prefill_rank_port, message)

    def register_declaring(self, prefill_rank_port: int, rank_port: int) -> Dict[str, Any]:
        """Sends the prefill SGLang's own registration of this decode
        declaring ``rank_port`` as its own (another decode's, as two hosts
        advertising one address would): the rest, its agent and metadata
        among it, unchanged."""
        message = self.manager.build_receiver_registration_message()
        assert message[3] == str(self.manager.rank_port).encode("ascii"), "SGLang's registration layout changed"
        message[3] = str(rank_port).encode("ascii")
        return self._send_registration(prefill_rank_port, message)

    def _send_registration(self, prefill_rank_port: int, message: list) -> Dict[str, Any]:
        import zmq

        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.connect(f"tcp://127.0.0.1:{prefill_rank_port}")
        sock.send_multipart(message)
        sock.close(linger=5000)
        return {}

    def room(self, room: int, pages: list, src_pages: list, aux: int, prefill: str,
             within: float = 30.0) -> Dict[str, Any]:
        from sglang.srt.disaggregation.nixl.conn import NixlKVReceiver

        deadline = time.monotonic() + within
        while not self.manager.try_ensure_parallel_info(prefill):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no parallel info from the prefill's bootstrap server {prefill}")
            time.sleep(0.1)
        receiver = NixlKVReceiver(self.manager, prefill, room)
        receiver.init(0)
        receiver.send_metadata(np.array(pages, dtype=np.int32), aux_index=aux)
        self.receivers[room] = receiver
        self.expect[room] = (pages, src_pages)
        return {}

    def wait(self, room: int, within: float) -> Dict[str, Any]:
        receiver = self.receivers[room]
        deadline = time.monotonic() + within
        while receiver.poll() not in (0, 4) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        pages, src_pages = self.expect[room]
        verified = all(
            np.array_equal(buf[d * self.item:(d + 1) * self.item], env.page_bytes(room, b, s, self.item))
            for b, buf in enumerate(self.kv) for d, s in zip(pages, src_pages))
        return {"status": STATUS[receiver.poll()], "verified": verified}

    def notifs(self, take: bool = True) -> Dict[str, Any]:
        drained = getattr(self.manager, "heartbeats_drained", None)
        if not take:
            return {"drained": drained}
        waiting = self.manager.agent.get_new_notifs()
        messages = [m for ms in waiting.values() for m in ms]
        heartbeats = sum(1 for m in messages if m.startswith(b"HB:"))
        self.heartbeats_seen += heartbeats
        return {"waiting": len(messages), "heartbeats": heartbeats, "heartbeats_seen": self.heartbeats_seen,
                "drained": drained}


def main() -> None:
    role = sys.argv[1]
    peer: Any = Prefill() if role == "prefill" else Decode()
    out = sys.stdout
    sys.stdout = sys.stderr  # SGLang prints; only replies go to the real stdout
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        name = command.pop("cmd")
        try:
            reply = {"ok": True, "pid": os.getpid(), **getattr(peer, name)(**command)}
        except Exception as e:
            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
