"""The RPC options of `tune`/`compile` and the addresses `tvmfuse rpc` binds: errors are one line (exit 2)."""
from __future__ import annotations

import pytest

from tvmfuse.rpc import RPCError, is_loopback, parse_address, rpc_options


def test_addresses():
    assert parse_address("127.0.0.1:9190") == ("127.0.0.1", 9190)
    assert parse_address("gpu-host.lan:9190") == ("gpu-host.lan", 9190)
    assert parse_address("[::1]:9190") == ("::1", 9190)
    for bad in ("9190", "host:", ":9190", "host:port", "host:70000", ""):
        with pytest.raises(RPCError) as e:
            parse_address(bad)
        assert e.value.exit_code == 2 and "\n" not in str(e.value)


def test_loopback_is_what_stays_on_this_machine():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1") and is_loopback("127.1.2.3")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5") and not is_loopback("gpu-host.lan")


def test_tracker_and_key_go_together():
    assert rpc_options(None, None) is None
    opts = rpc_options("127.0.0.1:9190", "h200", workers=8)
    assert (opts.host, opts.port, opts.key, opts.workers, opts.tracker) == ("127.0.0.1", 9190, "h200", 8,
                                                                           "127.0.0.1:9190")
    for tracker, key, workers in (("127.0.0.1:9190", None, None), (None, "h200", None), (None, None, 4),
                                  ("127.0.0.1:9190", "h200", 0), ("127.0.0.1:9190", " ", None)):
        with pytest.raises(RPCError):
            rpc_options(tracker, key, workers=workers)
