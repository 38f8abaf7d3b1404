"""SGLang 0.5.23's real NIXL prefill with the keepalive embedded
(``nixl_keepalive.sglang.KeepaliveNixlKVManager``), writing into SGLang's
real decode ranks, every rank its own process (``peer.py``), on NIXL
1.5.1's real runtime over loopback, KV in DRAM.

Each room goes the way SGLang's schedulers drive it: the decode's
``NixlKVReceiver`` asks the prefill's bootstrap server for the prefill's
ranks, registers its KV args (the prefill's bootstrap thread adds the
decode: ``_add_remote_peer``) and sends the room's page indices; the
prefill's ``NixlKVSender`` queues the pages and SGLang's transfer worker
WRITEs them, then tells the decode over ZMQ. The decode checks every page.

The control (``test_without_the_keepalive_...``) is SGLang alone: it shows
what the keepalive is for, and fails if SGLang stops holding (and
reloading) a dead decode's metadata.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
from conftest import free_port

#: The service's heartbeat interval here; a SIGKILLed decode is found by the
#: first heartbeat after the kill (one interval, plus jitter: at most 1.1x).
INTERVAL_S = 0.25
KNOBS = {"interval": "250ms", "read_stall": "1s"}
#: What a deadline adds to the bound under test on a loaded 2-core machine.
MARGIN_S = 10.0
#: How often the decode side takes waiting notifications (the default).
DRAIN_S = 1.0
OURS = "nixl_keepalive.sglang.KeepaliveNixlKVManager"
SGLANGS = "sglang.srt.disaggregation.nixl.conn.NixlKVManager"


def _pair(ranks, keepalive: bool = True, item: int = 512, decode_keepalive: bool = False):
    port = free_port()
    prefill = ranks("prefill", bootstrap_port=port, keepalive=keepalive, knobs=KNOBS if keepalive else {},
                    item=item)
    decode = ranks("decode", bootstrap_port=port, item=item, keepalive=decode_keepalive)
    prefill, decode = prefill.started(), decode.started()
    # The class SGLang's own lookup built: the plugin's switch, not the test,
    # put the keepalive there.
    for rank, on in ((prefill, keepalive), (decode, decode_keepalive)):
        assert rank.info["manager"] == (OURS if on else SGLANGS), rank.info
    return prefill, decode, f"127.0.0.1:{port}"


def _room(prefill, decode, bootstrap: str, room: int) -> None:
    """Bootstraps one room: 4 source pages into 4 other pages of the decode."""
    src = [4 * (room % 7) + i for i in range(4)]
    dst = [(5 * room + 3 * i) % 32 for i in range(4)]
    prefill.call("room", room=room, pages=src, aux=room % 8)
    decode.call("room", room=room, pages=dst, src_pages=src, aux=room % 8, prefill=bootstrap)
    assert prefill.call("bootstrapped", room=room, within=60)["status"] == "waiting_for_input"


def _state_once(prefill, decode: str, ready, within: float = 30.0):
    """The prefill's state of ``decode`` once ``ready(state)`` holds (polled,
    up to ``within`` seconds; the last state is returned either way)."""
    deadline = time.monotonic() + within
    state = prefill.call("state", decode=decode)
    while not ready(state) and time.monotonic() < deadline:
        time.sleep(0.05)
        state = prefill.call("state", decode=decode)
    return state


def _send_verified(prefill, decode, room: int) -> None:
    sent = prefill.call("send", room=room, within=60)
    assert sent["status"] == "success", sent
    got = decode.call("wait", room=room, within=60)
    assert got == {"ok": True, "pid": got["pid"], "status": "success", "verified": True}, got


def test_writes_into_a_live_decode_are_guarded_verified_and_heartbeated(ranks):
    prefill, decode, bootstrap = _pair(ranks)
    for room in range(1, 9):
        _room(prefill, decode, bootstrap, room)
        _send_verified(prefill, decode, room)
    state = _state_once(prefill, decode.agent, lambda st: st["engines"][decode.agent]["last_heartbeat"] is not None)
    assert state["in_table"] and state["prep_handles"] and state["metadata_loaded"], state
    engine = state["engines"][decode.agent]
    assert engine["state"] == "live" and engine["reads_in_flight"] == 0, state
    assert state["open_guards"] == 0 and state["given_up"] == 0, state
    assert engine["last_heartbeat"] is not None and engine["last_heartbeat"]["status"] == 0, state
    # SGLang's decode never reads NIXL notifications: every heartbeat waits
    # in its agent until something does (docs/push-mode.md, "SGLang 0.5.23").
    deadline = time.monotonic() + 30
    while (notifs := decode.call("notifs"))["heartbeats_seen"] < 8:
        assert time.monotonic() < deadline, f"fewer than 8 heartbeats reached the decode in 30 s: {notifs}"
        time.sleep(4 * INTERVAL_S)
    sys.stderr.write(f"\nsglang: 8 rooms verified; {notifs['heartbeats_seen']} heartbeats sat unread in the "
                     "decode's agent\n")


def test_a_killed_decode_is_released_its_tables_dropped_and_not_reloaded(ranks):
    prefill, decode, bootstrap = _pair(ranks)
    _room(prefill, decode, bootstrap, 1)
    _send_verified(prefill, decode, 1)
    prefill.call("keep_dlists", decode=decode.agent)  # a reference that outlives the release
    _room(prefill, decode, bootstrap, 2)  # bootstrapped, not sent: the decode dies first
    killed_at = decode.kill()
    released = prefill.call("wait_released", decode=decode.agent, within=1.1 * INTERVAL_S + MARGIN_S)
    assert released["released"], released
    sys.stderr.write(f"\nsglang: decode released {1000 * (released['at'] - killed_at):.0f} ms after SIGKILL "
                     f"(heartbeat interval {1000 * INTERVAL_S:.0f} ms)\n")
    state = prefill.call("state", decode=decode.agent)
    assert not state["in_table"] and not state["prep_handles"], state
    assert not state["metadata_loaded"] and state["send_notif"] == "nixlNotFoundError", state
    assert state["released"] == [decode.agent] and decode.agent not in state["engines"], state
    # The room bootstrapped for the dead decode fails in SGLang's own error
    # path, whose _reload_invalidated_peers then skips the released decode.
    sent = prefill.call("send", room=2, within=60)
    assert sent["status"] == "failed", sent
    sys.stderr.write(f"\nsglang: the released decode's room failed with: {sent['failure']}\n")
    assert "KVTransferError(bootstrap_room=2)" in str(sent["failure"]), sent
    # A WRITE with the released decode's dlist: refused, saying whose it
    # was, before anything reaches NIXL (it ran unguarded before).
    before = prefill.call("state", decode=decode.agent)["refused_unguarded"]
    assert before == 0, "room 2 failed in SGLang's own path (its tables dropped), not by a stale write"
    stale = prefill.call("write_kept")
    assert stale.get("refused") == "ReadRefused", stale
    assert f"decode {decode.agent} was released" in stale["message"], stale
    assert "nothing was posted" in stale["message"] and stale["refused_unguarded"] == before + 1, stale
    after = prefill.call("state", decode=decode.agent)
    assert not after["metadata_loaded"] and not after["in_table"] and not after["reloaded"], after
    again = prefill.call("reload", decode=decode.agent)
    assert not again["metadata_loaded"] and not again["in_table"], again


def test_without_the_keepalive_sglang_keeps_and_reloads_a_dead_decode(ranks):
    prefill, decode, bootstrap = _pair(ranks, keepalive=False)
    _room(prefill, decode, bootstrap, 1)
    _send_verified(prefill, decode, 1)
    _room(prefill, decode, bootstrap, 2)
    decode.kill()
    # Nothing in SGLang looks: 8 of the keepalive's intervals later the dead
    # decode's metadata (its remote keys) is still loaded.
    time.sleep(8 * INTERVAL_S)
    held = prefill.call("state", decode=decode.agent)
    assert held["in_table"] and held["metadata_loaded"] and not held["reloaded"], held
    sent = prefill.call("send", room=2, within=60)
    assert sent["status"] == "failed", sent
    # The failed WRITE (REMOTE_DISCONNECT at the post) changes nothing:
    # NIXL 1.5.1 keeps the dead decode's metadata, so SGLang's
    # _reload_invalidated_peers (written for NIXL releases that drop it)
    # finds it loaded and leaves it, and SGLang's tables keep the decode.
    after = prefill.call("state", decode=decode.agent)
    assert after["in_table"] and after["metadata_loaded"] and not after["reloaded"], after


def test_a_registration_naming_another_agent_is_refused_and_the_decode_drains_heartbeats(ranks):
    prefill, decode, bootstrap = _pair(ranks, decode_keepalive=True)
    _room(prefill, decode, bootstrap, 1)
    _send_verified(prefill, decode, 1)
    # A registration whose agent-name frame is not the agent its metadata
    # loads as: SGLang would table it under the frame's name while NIXL
    # loads the metadata's; refused before anything is loaded.
    decode.call("register_forged", prefill_rank_port=prefill.info["rank_port"], name="forged-agent")
    forged = _state_once(prefill, "forged-agent", lambda st: st["refused_registrations"] > 0)
    assert forged["refused_registrations"] == 1 and not forged["in_table"], forged
    assert list(forged["engines"]) == [decode.agent], forged
    _room(prefill, decode, bootstrap, 2)
    _send_verified(prefill, decode, 2)
    # The decode side of nixl_keepalive.sglang takes the heartbeats SGLang
    # never reads (every DRAIN_S): at most a few wait at any time.
    deadline = time.monotonic() + 30
    while decode.call("notifs", take=False)["drained"] < 4:
        assert time.monotonic() < deadline, "the decode drained fewer than 4 heartbeats in 30 s"
        time.sleep(0.05)
    notifs = decode.call("notifs")
    assert notifs["heartbeats"] <= DRAIN_S / INTERVAL_S + 3, notifs


def test_a_decode_declaring_a_live_decodes_address_is_refused_and_the_live_one_kept(ranks):
    prefill, decode, bootstrap = _pair(ranks)
    _room(prefill, decode, bootstrap, 1)
    _send_verified(prefill, decode, 1)
    # A second decode (its own agent and metadata) whose registration
    # declares the live decode's rank_ip:rank_port as its own: two hosts
    # advertising one address. Its word does not replace the live one.
    other = ranks("decode", bootstrap_port=int(bootstrap.rsplit(":", 1)[1]), item=512).started()
    sent_at = time.monotonic()
    other.call("register_declaring", prefill_rank_port=prefill.info["rank_port"],
               rank_port=decode.info["rank_port"])
    refused = _state_once(prefill, other.agent, lambda st: st["refused_registrations"] > 0)
    refused_after = time.monotonic() - sent_at
    assert refused["refused_registrations"] == 1 and refused["declared_conflicts"] == 1, refused
    assert refused["declared_waits"] == 1, refused
    assert not refused["in_table"] and not refused["metadata_loaded"], refused
    assert list(refused["engines"]) == [decode.agent] and refused["released"] == [], refused
    # Again at once: the live decode outlived a wait just now, so SGLang's
    # bootstrap thread does not wait for it again.
    other.call("register_declaring", prefill_rank_port=prefill.info["rank_port"],
               rank_port=decode.info["rank_port"])
    again = _state_once(prefill, other.agent, lambda st: st["refused_registrations"] > 1)
    assert again["refused_registrations"] == 2 and again["declared_conflicts"] == 2, again
    assert again["declared_waits"] == 1 and list(again["engines"]) == [decode.agent], again
    kept = prefill.call("state", decode=decode.agent)
    assert kept["in_table"] and kept["metadata_loaded"] and kept["send_notif"] == "sent", kept
    _room(prefill, decode, bootstrap, 2)
    _send_verified(prefill, decode, 2)
    sys.stderr.write(f"\nsglang: a registration declaring a live decode's address refused {1000 * refused_after:.0f} "
                     "ms after it was sent (the live decode heartbeated, kept and written)\n")


def test_a_decode_gone_from_the_address_another_declares_is_asked_released_and_the_new_one_taken(ranks):
    # Heartbeats every 10 minutes and endpoint events off: only the
    # heartbeat the declaration makes the service send at once can find
    # the dead decode within this test (the events would find the kill
    # first, before the declaration).
    port = free_port()
    prefill = ranks("prefill", bootstrap_port=port, keepalive=True,
                    knobs={"interval": "600s", "endpoint_events": "off"}, item=512)
    first = ranks("decode", bootstrap_port=port, item=512)
    second = ranks("decode", bootstrap_port=port, item=512)
    prefill, first, second = prefill.started(), first.started(), second.started()
    bootstrap = f"127.0.0.1:{port}"
    _room(prefill, first, bootstrap, 1)
    _send_verified(prefill, first, 1)
    killed_at = first.kill()
    second.call("register_declaring", prefill_rank_port=prefill.info["rank_port"],
                rank_port=first.info["rank_port"])
    # Taken means registered with the service too: SGLang tables a decode
    # on its bootstrap thread just before the plugin registers it there, so
    # a state read in between sees it tabled and not yet an engine (CI did).
    taken = _state_once(prefill, second.agent, lambda st: st["in_table"] and second.agent in st["engines"])
    taken_after = time.monotonic() - killed_at
    assert taken["in_table"] and taken["metadata_loaded"] and taken["send_notif"] == "sent", taken
    assert taken["declared_conflicts"] == 1 and taken["declared_waits"] == 1, taken
    assert taken["refused_registrations"] == 0, taken
    assert taken["released"] == [first.agent] and list(taken["engines"]) == [second.agent], taken
    assert taken_after < MARGIN_S, f"taken {taken_after:.1f} s after the kill (heartbeats every 600 s)"
    gone = prefill.call("state", decode=first.agent)
    assert not gone["in_table"] and not gone["metadata_loaded"], gone
    sys.stderr.write(f"\nsglang: a dead decode's address declared by a new decode: the dead one released and "
                     f"the new one registered {1000 * taken_after:.0f} ms after the SIGKILL (heartbeats every 600 s)\n")


def _stopped(pid: int) -> bool:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        return all(open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[0] in "Tt" for t in tasks)
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_frozen_decode_is_never_released_under_a_write_then_released_when_it_ends(ranks):
    # 1 MiB pages (16 MiB a room): a write is still on the wire when the
    # stop lands; small ones complete into the socket buffers.
    prefill, decode, bootstrap = _pair(ranks, item=1 << 20)
    _room(prefill, decode, bootstrap, 1)
    _send_verified(prefill, decode, 1)
    _room(prefill, decode, bootstrap, 2)
    os.kill(decode.proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while not _stopped(decode.proc.pid):
        assert time.monotonic() < deadline, "decode not stopped 10 s after SIGSTOP"
        time.sleep(0.001)
    # SGLang waits for a healthy batch without a bound: the write into the
    # frozen decode stays in progress, and so does its guard.
    sent = prefill.call("send", room=2, within=4.0)
    assert sent["status"] == "transferring", sent
    state = prefill.call("state", decode=decode.agent)
    engine = state["engines"][decode.agent]
    # Two guards: the room's KV write and its aux write (the last chunk's).
    assert engine["state"] == "stalled" and engine["reads_in_flight"] == 2, state
    assert state["open_guards"] == 2, state
    assert state["in_table"] and state["metadata_loaded"] and state["released"] == [], state
    # The writes stay in progress after the SIGKILL too (measured: 90 s and
    # on); the idle heartbeat the watcher sends a marked decode answers
    # REMOTE_DISCONNECT, and only then are they abandoned and it released.
    killed_at = decode.kill()
    released = prefill.call("wait_released", decode=decode.agent, within=MARGIN_S + 5)
    assert released["released"], (released, prefill.call("state", decode=decode.agent))
    sys.stderr.write(f"\nsglang: frozen decode released {1000 * (released['at'] - killed_at):.0f} ms after "
                     "its SIGKILL (its writes abandoned once UCX said it was gone)\n")
    after = prefill.call("state", decode=decode.agent)
    assert after["open_guards"] == 0 and not after["metadata_loaded"] and not after["in_table"], after
    assert after["given_up"] == 2 and after["given_up_ended"] == {"abandoned_unreachable": 2}, after


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
