"""The vLLM connectors' knobs: ``kv_connector_extra_config["keepalive"]``
split into :class:`nixl_keepalive.Config` keywords and the connectors' own
(``read_timeout``, ``control_addr``, ``control_token_file``), every refusal
naming what was wrong and what is accepted. Needs no vLLM: the pull
connector (:mod:`nixl_keepalive.vllm`) and the push one read their knobs
here, and a launcher can check a config before it starts vLLM."""

from __future__ import annotations

import difflib
import json
import re
from typing import Any, Dict, Optional, Tuple

import nixl_keepalive

__all__ = ["control_addr_of_rank", "keepalive_knobs"]

#: This module's own knobs in ``kv_connector_extra_config["keepalive"]``
#: (the rest are :class:`nixl_keepalive.Config` keywords).
_OWN_KNOBS = ("read_timeout", "control_addr", "control_token_file")

#: The :class:`nixl_keepalive.Config` keywords, from the service's own
#: table of knobs (its ``env`` and ``seed`` are options of the Python API,
#: not knobs).
_CONFIG_KNOBS = tuple(k["keyword"] for k in nixl_keepalive.knobs())

_KNOBS = _CONFIG_KNOBS + _OWN_KNOBS

def _did_you_mean(name: str, choices: Tuple[str, ...]) -> str:
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _squashed(key: str) -> str:
    return re.sub(r"[^a-z]", "", key.lower())


def _seconds(name: str, value: Any) -> Optional[float]:
    """A time knob: seconds (number), a UCX time string (``"5s"``,
    ``"250ms"``, read by the service's own parser:
    :func:`nixl_keepalive.parse_ucx_time`), ``"inf"``/``None`` (none)."""
    accepted = "expected seconds, a UCX time (\"5s\", \"250ms\") or \"inf\""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"keepalive knob {name}={value!r}: {accepted}")
    if isinstance(value, (int, float)):
        seconds: Optional[float] = float(value)
    elif isinstance(value, str):
        try:
            seconds = nixl_keepalive.parse_ucx_time(value)
        except ValueError as e:
            raise ValueError(f"keepalive knob {name}={value!r}: {e}") from None
    else:
        raise ValueError(f"keepalive knob {name}={value!r}: {accepted}")
    if seconds is None or seconds == float("inf"):
        return None
    if not seconds > 0:
        raise ValueError(f"keepalive knob {name}={value!r}: must be > 0 (or \"inf\" for none)")
    return seconds


def keepalive_knobs(kv_transfer_config: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Splits ``kv_connector_extra_config["keepalive"]`` into
    (:class:`nixl_keepalive.Config` keywords, this module's own knobs).
    Raises ``ValueError`` naming what was wrong and what is accepted: an
    unknown knob (with the nearest accepted name), a knob placed at the top
    of ``kv_connector_extra_config`` (where vLLM would ignore it), or a
    misspelt ``keepalive`` key."""
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    accepted = ", ".join(_KNOBS)
    for key in extra:
        if not isinstance(key, str) or key == "keepalive":
            continue
        if key in _KNOBS:
            raise ValueError(
                f"kv_connector_extra_config[{key!r}] is a keepalive knob at the top level, where vLLM ignores "
                f"it; put it under \"keepalive\": {{\"keepalive\": {{{json.dumps(key)}: ...}}}}"
            )
        if "keepalive" in _squashed(key) or difflib.get_close_matches(key.lower(), ["keepalive"], cutoff=0.8):
            raise ValueError(
                f"kv_connector_extra_config[{key!r}] is not read by the keepalive: its knobs go under the key "
                f"\"keepalive\" (e.g. {{\"keepalive\": {{\"interval\": \"1s\"}}}}); accepted knobs: {accepted}"
            )
    knobs = extra.get("keepalive", {})
    if knobs is None:
        knobs = {}
    if not isinstance(knobs, dict):
        raise ValueError(
            "kv_connector_extra_config['keepalive'] must be a JSON object of keepalive knobs "
            f"(e.g. {{\"interval\": \"1s\", \"read_timeout\": \"10s\"}}); got {type(knobs).__name__}"
        )
    unknown = [k for k in knobs if k not in _KNOBS]
    if unknown:
        raise ValueError(
            "kv_connector_extra_config['keepalive'] has unknown knob(s): "
            + ", ".join(f"{k!r}{_did_you_mean(str(k), _KNOBS)}" for k in unknown)
            + f"; accepted: {accepted}"
        )
    config = {k: v for k, v in knobs.items() if k not in _OWN_KNOBS}
    own = {
        "read_timeout": _seconds("read_timeout", knobs.get("read_timeout")),
        "control_addr": _control_addr(knobs.get("control_addr")),
        "control_token_file": knobs.get("control_token_file"),
    }
    if own["control_token_file"] is not None and not isinstance(own["control_token_file"], str):
        raise ValueError(f"keepalive knob control_token_file={own['control_token_file']!r}: expected a file path")
    if own["control_token_file"] is not None and own["control_addr"] is None:
        raise ValueError("keepalive knob control_token_file without control_addr: give the address to serve on too")
    return config, own


def _control_addr(value: Any) -> Optional[Tuple[str, int]]:
    """``control_addr``: ``"host:port"`` (the first rank's port; each rank
    serves on port + its tensor-parallel rank; port 0: each rank picks a
    free one). Returns (host, port)."""
    if value is None:
        return None
    wrong = (f"keepalive knob control_addr={value!r}: expected \"host:port\" (an IP address or localhost; "
             "rank r serves on port + r; port 0 picks a free port per rank)")
    if not isinstance(value, str) or ":" not in value:
        raise ValueError(wrong)
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(wrong)
    return host, int(port)


def control_addr_of_rank(addr: Tuple[str, int], rank: int) -> str:
    """The address rank ``rank`` serves the control endpoint on."""
    host, port = addr
    if port == 0:
        return f"{host}:0"
    if port + rank > 65535:
        raise ValueError(f"keepalive knob control_addr={host}:{port}: rank {rank} would serve on port "
                         f"{port + rank}, past 65535; choose a lower first port")
    return f"{host}:{port + rank}"
