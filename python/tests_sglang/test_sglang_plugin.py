"""The SGLang plugin (``nixl_keepalive_plugins:sglang``) as SGLang 0.5.23
loads it: through its entry-point group, by ``sglang.srt.plugins.
load_plugins()`` (what ``run_scheduler_process`` calls first), and read back
through SGLang's own class lookup, ``get_kv_class``. Each case is a fresh
process: plugins load once per process. The keepalive's work in the ranks
this plugin sets up is test_sglang_real.py's."""

from __future__ import annotations

import json

SWITCH = "NIXL_KEEPALIVE_SGLANG"

LOAD = """
import json, sys
from importlib.metadata import entry_points
ours = [f"{ep.name} = {ep.value}" for ep in entry_points(group="sglang.srt.plugins")
        if ep.value.startswith("nixl_keepalive")]
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
cls = get_kv_class(TransferBackend.NIXL, KVClassType.MANAGER)
print(json.dumps({"entry_points": ours, "manager": f"{cls.__module__}.{cls.__qualname__}",
                  "imported": "nixl_keepalive" in sys.modules}))
"""


def _loaded(sglang_process, **env):
    done = sglang_process(LOAD, env)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # The plugin is installed where SGLang looks: a case below cannot pass
    # because SGLang never saw it.
    assert out["entry_points"] == ["nixl_keepalive = nixl_keepalive_plugins:sglang"], out
    return out


def test_on_sglang_builds_the_keepalive_manager(sglang_process):
    out = _loaded(sglang_process, **{SWITCH: "1"})
    assert out["manager"] == "nixl_keepalive.sglang.KeepaliveNixlKVManager", out
    assert out["imported"], out


def test_off_or_unset_leaves_sglang_as_it_is_and_imports_nothing(sglang_process):
    for value in (None, "0"):
        out = _loaded(sglang_process, **{SWITCH: value})
        assert out["manager"] == "sglang.srt.disaggregation.nixl.conn.NixlKVManager", (value, out)
        assert not out["imported"], (value, out)


def test_a_bad_switch_or_knob_stops_start_up_naming_it(sglang_process):
    # SGLang's loader logs an exception from a plugin and goes on; the
    # plugin exits instead, so no server starts without what was asked for.
    for env, named, accepted in (
        ({SWITCH: "yes"}, "NIXL_KEEPALIVE_SGLANG='yes'", "1 (the keepalive"),
        ({SWITCH: "1", "NIXL_KEEPALIVE_INTERVAL": "fast"}, "NIXL_KEEPALIVE_INTERVAL", "fast"),
    ):
        done = sglang_process(LOAD, env)
        assert done.returncode != 0, (env, done.stdout)
        assert named in done.stderr and accepted in done.stderr, (env, done.stderr[-4000:])
        assert "manager" not in done.stdout, (env, done.stdout)
