"""The vLLM plugin (``nixl_keepalive_plugins:vllm``, entry-point group
``vllm.general_plugins``): off by default and importing nothing of ours;
with ``NIXL_KEEPALIVE_VLLM=1`` the name launchers write,
``"kv_connector": "NixlConnector"``, builds the keepalive connector through
vLLM's own factory, and vLLM's push-mode name, ``NixlPushConnector``,
builds the push keepalive connector; a bad switch fails loudly; NVIDIA Dynamo's
argument check accepts that configuration."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Every scenario here runs on every tested release in CI (conftest.EVERY_RELEASE).
pytestmark = pytest.mark.every_release


from conftest import real_required

SWITCH = "NIXL_KEEPALIVE_VLLM"


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter (vLLM runs its plugins once per
    process), with ``env`` over this process's environment."""
    full = dict(os.environ)
    full.pop(SWITCH, None)
    full.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full, timeout=300)


_FACTORY = """
    import sys
    from vllm.plugins import load_general_plugins
    load_general_plugins()  # vLLM's own loader, as every vLLM process runs it
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    def cls(name="NixlConnector", **extra):
        kv = KVTransferConfig(kv_connector=name, kv_role="kv_consumer",
                              kv_connector_extra_config=extra)
        try:
            c = KVConnectorFactory.get_connector_class(kv)
        except Exception as e:
            return f"refused: {e}"
        return f"{c.__module__}.{c.__name__}"
"""


def test_off_by_default_vllm_builds_its_own_and_nothing_of_ours_is_imported(vllm_ready):
    out = _python(_FACTORY + """
    print("CLASS", cls())
    print("OURS", sorted(m for m in sys.modules if m.startswith("nixl_keepalive")))
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "CLASS vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector.Nixl" in out.stdout, out.stdout
    assert "OURS ['nixl_keepalive_plugins']" in out.stdout, out.stdout
    off = _python(_FACTORY + """
    print("CLASS", cls())
    """, **{SWITCH: "0"})
    assert off.returncode == 0, off.stderr[-3000:]
    assert "CLASS vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector.Nixl" in off.stdout, off.stdout


def test_on_nixlconnector_is_the_keepalive_connector_through_vllms_factory(vllm_ready):
    out = _python(_FACTORY + """
    print("PULL", cls())
    print("PULL_EXPLICIT", cls(transfer_mode="pull"))
    print("PUSH", cls(transfer_mode="push"))
    print("PUSH_NAME", cls("NixlPushConnector"))
    """, **{SWITCH: "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert lines["PULL"] == "nixl_keepalive.vllm.KeepaliveNixlConnector", out.stdout
    # 0.33 has no transfer_mode (NixlConnector is the pull connector); 0.34
    # resolves "pull" to NixlPullConnector: ours either way.
    assert lines["PULL_EXPLICIT"] == "nixl_keepalive.vllm.KeepaliveNixlConnector", out.stdout
    import importlib.metadata as m

    # Push mode: vLLM's own name builds the push keepalive connector; 0.34
    # resolves NixlConnector with transfer_mode "push" to that name.
    assert lines["PUSH_NAME"] == "nixl_keepalive.vllm_push.KeepaliveNixlPushConnector", out.stdout
    if not m.version("vllm").startswith("0.33"):
        assert lines["PUSH"] == "nixl_keepalive.vllm_push.KeepaliveNixlPushConnector", out.stdout


@pytest.mark.parametrize("value", ["yes", "true", "2", "on"])
def test_a_bad_switch_stops_the_process_naming_what_is_accepted(vllm_ready, value):
    out = _python("""
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    print("STARTED")
    """, **{SWITCH: value})
    assert out.returncode != 0 and "STARTED" not in out.stdout
    assert f"{SWITCH}={value!r} is not accepted: 1" in out.stderr, out.stderr[-2000:]


def test_a_bad_knob_in_the_environment_stops_the_process_when_on(vllm_ready):
    out = _python("""
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    print("STARTED")
    """, **{SWITCH: "1", "NIXL_KEEPALIVE_INTERVAL": "sometimes"})
    assert out.returncode != 0 and "STARTED" not in out.stdout
    assert "NIXL_KEEPALIVE_INTERVAL" in out.stderr, out.stderr[-2000:]


def test_a_decode_built_by_the_name_nixlconnector_runs_the_service(vllm_ready, monkeypatch, decode):
    """In this process: the plugin applied, a worker built by vLLM's
    factory from ``"kv_connector": "NixlConnector"`` with no module path."""
    import nixl_keepalive_plugins
    import vllm_env
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from nixl_keepalive.vllm import KeepaliveNixlConnectorWorker

    for name in nixl_keepalive_plugins.VLLM_PULL_NAMES + (nixl_keepalive_plugins.VLLM_PUSH_NAME,):
        monkeypatch.setitem(KVConnectorFactory._registry, name, KVConnectorFactory._registry[name])
    monkeypatch.setenv(SWITCH, "1")
    nixl_keepalive_plugins.vllm()
    d = decode(connector=vllm_env.VLLM_CONNECTOR)
    assert isinstance(d.worker, KeepaliveNixlConnectorWorker)
    assert d.ka is not None and d.ka.snapshot()["heartbeat_delivery"] == "progress_thread"


def _dynamo_protocols():
    spec = importlib.util.find_spec("dynamo")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "vllm" / "kv_connector_protocols.py"
    if not path.exists():
        return None
    # That module imports only the standard library; dynamo's package
    # __init__ files (its native runtime) are not needed for the check.
    mod_spec = importlib.util.spec_from_file_location("dynamo_kv_connector_protocols", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


def test_dynamos_vllm_argument_check_accepts_the_plugin_configuration(vllm_ready):
    protocols = _dynamo_protocols()
    if protocols is None:
        why = "ai-dynamo 1.6.1 is not installed in this venv (scripts/install-vllm.sh installs it)"
        if real_required():
            pytest.fail(why)
        sys.stderr.write(f"\nSKIPPED (Dynamo check): {why}\n")
        pytest.skip(why)
    import vllm_env

    ours = vllm_env.vllm_config(vllm_env.KEEPALIVE_CONNECTOR, "dynamo-check", kv_role="kv_consumer")
    with pytest.raises(ValueError, match="Unsupported kv_connector='KeepaliveNixlConnector'"):
        protocols.make_kv_connector_protocol(ours)
    by_name = vllm_env.vllm_config(vllm_env.VLLM_CONNECTOR, "dynamo-check", kv_role="kv_consumer")
    protocol = protocols.make_kv_connector_protocol(by_name)
    assert type(protocol).__name__ == "NixlConnectorProtocol"
    # And that configuration, with the switch on, is the keepalive's
    # (test_on_nixlconnector_is_the_keepalive_connector_through_vllms_factory).
