"""Joining a Ray cluster fails within seconds, in one line naming the address and the fix.

`ray.init(address=...)` waits minutes where nothing listens, and fails after about 20 s with a
traceback when the driver lacks the cluster's auth token. So before it, the driver asks the
cluster's GCS one cheap question (GetClusterId, over gRPC, with this process's token when Ray's
token authentication is on here, as ray.init would send it) under a deadline, and turns the answer
into a ConfigError naming `ray_init.address` (or RAY_ADDRESS, when that is where it came from).
"""

from __future__ import annotations

import os
import socket
from typing import Any, Optional

from verl_async.config.errors import ConfigError

PROBE_TIMEOUT_S = 5.0
GCS_METHOD = "/ray.rpc.NodeInfoGcsService/GetClusterId"  # an empty request: any GCS answers it
TOKEN_FIX = ("set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH to a copy of the head node's token file "
             "(`ray get-auth-token` prints it there; RAY_AUTH_TOKEN=<token> works too)")


def ray_address(cfg: Any) -> tuple[Optional[str], str]:
    """(the cluster address this run joins, the key that set it); (None, ...) for a local Ray."""
    address = cfg.ray_init.get("address")
    key = "ray_init.address"
    if not address:
        address, key = os.environ.get("RAY_ADDRESS") or None, "RAY_ADDRESS"
    if address in (None, "", "local"):
        return None, key
    return str(address), key


def check_ray_address(cfg: Any, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Raise ConfigError when the configured cluster cannot be joined; nothing for a local Ray."""
    address, key = ray_address(cfg)
    if address is None:
        return
    found = probe(address, timeout_s)
    if found:
        raise ConfigError(key, f"{address}: {found}")


def _split(address: str) -> Optional[tuple[str, int]]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def started_cluster_here() -> Optional[str]:
    """The address of the cluster the last `ray start` on this machine left (Ray's ray_current_cluster file), if any."""
    try:
        from ray._private.services import find_bootstrap_address

        return find_bootstrap_address(None)
    except Exception:  # noqa: BLE001 - none, or Ray's private helper moved: nothing to say
        return None


def _auto_address() -> Optional[str]:
    """address=auto: the cluster `ray start` left on this machine (as ray.init finds it), or None."""
    try:
        from ray._private.services import canonicalize_bootstrap_address

        return canonicalize_bootstrap_address("auto")
    except Exception:  # noqa: BLE001 - none found, or Ray's private helper moved: the caller says so
        return None


def probe(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """What stops a driver from joining `address` (why, and the fix), or None when its GCS answers."""
    client = address.startswith("ray://")
    target = address[len("ray://"):] if client else address
    if target == "auto":
        target = _auto_address() or ""
        if not target:
            return "no Ray cluster was started on this machine (`ray start --head` starts one); or give its host:port"
    parts = _split(target)
    if parts is None:
        return "expected host:port (the address `ray start --head` prints, e.g. 10.0.0.1:6379)"
    host, port = parts
    try:
        socket.getaddrinfo(host, port)
    except socket.gaierror as exc:
        return f"cannot resolve the host {host!r} ({exc.strerror}); fix the address"
    if client:  # Ray Client's server speaks its own protocol: that it accepts connections is all we check
        return _tcp_problem(host, port, timeout_s)
    return _gcs_problem(host, port, timeout_s)


def _tcp_problem(host: str, port: int, timeout_s: float) -> Optional[str]:
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return _refused(port)
    except OSError as exc:
        return _unreachable(host, port, timeout_s, exc.strerror or type(exc).__name__)
    return None


def _refused(port: int) -> str:
    return (f"nothing listens there (connection refused); start the head node with `ray start --head --port={port}` "
            "or give the address it printed")


def _unreachable(host: str, port: int, timeout_s: float, why: str) -> str:
    return (f"no answer within {timeout_s:g} s ({why}): the node is down or this machine cannot reach it "
            f"(route, firewall); check with `nc -zv {host} {port}`")


def _token_metadata() -> tuple[tuple[str, str], ...]:
    """The auth header ray.init would send from this process (none when token auth is off here)."""
    try:
        from ray._raylet import AuthenticationTokenLoader
    except ImportError:  # a Ray without token authentication
        return ()
    loader = AuthenticationTokenLoader.instance()
    return tuple(loader.get_token_for_http_header().items()) if loader.has_token() else ()


def _gcs_problem(host: str, port: int, timeout_s: float) -> Optional[str]:
    import grpc

    metadata = _token_metadata()
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        call = channel.unary_unary(GCS_METHOD, request_serializer=lambda _: b"", response_deserializer=lambda b: b)
        try:
            call(None, timeout=timeout_s, metadata=metadata)
            return None
        except grpc.RpcError as exc:
            code, detail = exc.code(), " ".join(str(exc.details() or "").split())
    if code == grpc.StatusCode.UNAUTHENTICATED:
        if metadata:
            return f"the cluster refused this driver's auth token (not the cluster's token); {TOKEN_FIX}"
        return f"the cluster has token authentication on and this driver sent no token; {TOKEN_FIX}"
    if code == grpc.StatusCode.UNAVAILABLE and "refused" in detail.lower():
        return _refused(port)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED or any(
            word in detail.lower() for word in ("no route", "unreachable", "timed out", "timeout")):
        return _unreachable(host, port, timeout_s, detail.rsplit(": ", 1)[-1] or code.name)
    return (f"something answers there, but not a Ray cluster's GCS ({code.name}: {detail[-160:]}); give the address "
            "`ray start --head` printed (port 6379 unless --port was set)")
