"""gunicorn's settings for `gunicorn app:app` run from this folder (gunicorn reads this file by itself).

Threads, not workers: an HTTP inference session lives in the process that opened it (as in Petals Chat).
With no initial peers configured, the master starts an embedded local swarm before it forks the worker,
and stops it when it exits (Ctrl-C and SIGTERM included).

A WebSocket holds one of the worker's threads for its whole life (flask-sock; simple-websocket adds a reader
thread of its own), so the threads are sized from the limits at start (config.Limits.worker_threads:
MAX_WEBSOCKETS + MAX_SESSIONS + HTTP_THREADS), with as many connections and open files as that takes; the
gateway refuses WebSockets past MAX_WEBSOCKETS, so they can never take the threads that HTTP requests need.
An idle thread costs little: it waits in a system call, and the pool starts threads only as they are needed.

The worker is gunicorn's gthread with each request's headers read by its event loop, never by a thread, within
HTTP_HEADER_TIMEOUT (gateway/web/slow_clients.py): silent or slow clients cannot take the threads.
"""

import math
import os

worker_class = "gateway.web.slow_clients.HeaderReadingWorker"
workers = 1
threads = 1  # raised to the limits' worker_threads in on_starting, once gunicorn's --env values are in place
bind = ["127.0.0.1:5000"]
timeout = 120
graceful_timeout = 10
# gunicorn's control socket has one default path per user: two gateways on one machine would fight over it
control_socket_disable = True

KEEPALIVE_CONNECTIONS = 1000  # idle keep-alive HTTP connections, beyond one per thread; they wait in the poller
FILES_PER_PROCESS = 1024  # besides the sockets: the swarm client's, torch's, the logs'
# Each thread's stack, in virtual memory (pages are touched only as used). 2 MiB instead of the usual 8 MiB keeps
# a worker with thousands of threads at a few GiB of address space. 512 KiB overflows (a segfault, the whole
# gateway) at Python's recursion limit through C calls; 1 MiB did not, in every probe (json, repr, re, pydantic,
# llguidance); 2 MiB leaves a margin, and is what Rust gives its own threads.
THREAD_STACK_BYTES = 2 << 20

_local_swarm = None


def on_starting(server):
    """Size the worker for the limits, and start the embedded swarm in the master, before the fork (the worker
    finds it through INITIAL_PEERS)."""
    global _local_swarm
    from config import Settings

    settings = Settings.from_env()
    _size_for_limits(server, settings.gateway.limits)
    _share_where_only_this_machine_reaches(server, settings.gateway.access)
    _fetch_hub_models(settings)
    if settings.swarm.initial_peers:
        return
    from swarm.cli import fail
    from swarm.local import start_for_models
    from swarm.protocol import SwarmError

    server.log.info("no initial peers configured: starting a local swarm")
    try:
        _local_swarm = start_for_models(settings)
    except SwarmError as error:  # a model it cannot serve (unknown, or a Hub model it cannot fetch): one line
        fail(str(error))
    os.environ["INITIAL_PEERS"] = " ".join(_local_swarm.initial_peers)
    server.log.info("local swarm ready: %s", os.environ["INITIAL_PEERS"])


def _fetch_hub_models(settings) -> None:
    """What the gateway loads of each served model named by its Hugging Face Hub id (config, tokenizer, the weight
    files of its embeddings, final norm and LM head), fetched here in the master before any worker exists: a download
    may take longer than gunicorn lets a worker boot (`timeout`: it would be killed and started again, forever), and a
    model the gateway cannot have (unknown, gated without HF_TOKEN, a wrong revision, a family not served, a disk
    without room) stops the start with one line rather than 404 every request."""
    from swarm.cli import fail
    from swarm.protocol import SwarmError
    from swarm.weights import fetch_client_files

    try:
        for model in settings.gateway.models:
            fetch_client_files(model.path, settings.swarm.cache_dir, model.revision)
    except SwarmError as error:
        fail(str(error))


def _share_where_only_this_machine_reaches(server, access, environ=os.environ) -> None:
    """KEYLESS_SHARING unset: on where every bind is on loopback (or a unix socket), so that the owner of a laptop's
    gateway gets prefix reuse and the stateful routes as vLLM and llama.cpp give them; off anywhere else, where an
    address may be a stranger's, with one line saying so (the worker reads the setting from the environment). A
    gateway behind reverse proxies (TRUSTED_PROXIES) listens on loopback for them: that says nothing of its callers."""
    from config import said

    if said("KEYLESS_SHARING", environ) is not None:
        return
    local = all(_loopback_only(bind) for bind in server.cfg.bind) and not access.trusted_proxies
    environ["KEYLESS_SHARING"] = "1" if local else "0"
    if not local and not access.api_keys:
        server.log.warning("listening on %s without API keys: clients are told apart only by their address, so prefix "
                           "reuse without a cache_salt, saved states and MLC's stateful chat are off; set API_KEYS to "
                           "give each client its own, or KEYLESS_SHARING=1 if everyone who can reach this gateway is "
                           "one trusted user", ", ".join(server.cfg.bind))


def _loopback_only(bind: str) -> bool:
    """Whether a gunicorn bind ("HOST:PORT", "[V6]:PORT", "HOST", "unix:PATH", "fd://N") is reachable from this
    machine alone."""
    import ipaddress

    if bind.startswith("unix:"):
        return True
    host = bind.rpartition(":")[0] if bind.count(":") == 1 or bind.startswith("[") else bind
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost, or fd://N: it may be anything
        return False


def _size_for_limits(server, limits):
    """Threads for every WebSocket and session the limits allow, plus headroom (a --threads or
    --worker-connections given on the command line may only add), and the open files their sockets take; idle
    keep-alive connections kept HTTP_KEEPALIVE seconds (gunicorn's default of 2 s is shorter than clients expect)."""
    server.cfg.set("keepalive", max(server.cfg.keepalive, math.ceil(limits.http_keepalive)))
    _say_keep_alive(math.floor(limits.http_keepalive))
    threads = max(server.cfg.threads, limits.worker_threads)
    connections = max(server.cfg.worker_connections, threads + KEEPALIVE_CONNECTIONS)
    server.cfg.set("threads", threads)
    server.cfg.set("worker_connections", connections)
    _read_headers_within_limits(server, limits)
    _raise_open_files(server, connections + _half_open_connections(server) + FILES_PER_PROCESS)
    server.log.info("%d threads (MAX_WEBSOCKETS + MAX_SESSIONS + HTTP_THREADS), %d connections", threads, connections)


def _read_headers_within_limits(server, limits) -> None:
    """The header-reading worker's limits (HTTP_HEADER_TIMEOUT, HALF_OPEN_PER_ADDRESS), set on its class in the
    master: the worker forked from it has them. Another worker class (--worker-class) is left as it is."""
    worker = server.cfg.worker_class
    if hasattr(worker, "limits_from"):
        worker.limits_from(limits)


def _half_open_connections(server) -> int:
    """The connections the worker may keep waiting for their headers besides worker_connections (their files)."""
    from gateway.web.slow_clients import HeaderReadingWorker, MAX_HALF_OPEN

    return MAX_HALF_OPEN if issubclass(server.cfg.worker_class, HeaderReadingWorker) else 0


def _say_keep_alive(seconds: int) -> None:
    """A Keep-Alive: timeout=N header on each reply whose connection stays open, which undici and the browsers read
    to close an idle connection before the gateway does. gunicorn drops the header from an app's replies (it is
    hop-by-hop, the server's to say) and has no setting for it: its response's own headers get it, as gunicorn
    decides the connection's fate there."""
    from gunicorn.http import wsgi

    gunicorns_headers = getattr(wsgi.Response.default_headers, "without_keep_alive", wsgi.Response.default_headers)

    def default_headers(response):
        headers = gunicorns_headers(response)
        if not response.upgrade and not response.should_close():
            headers.append(f"Keep-Alive: timeout={seconds}\r\n")
        return headers

    default_headers.without_keep_alive = gunicorns_headers  # a reload wraps gunicorn's own again, not this
    wsgi.Response.default_headers = default_headers


def _raise_open_files(server, needed: int) -> None:
    """The soft limit on open files up to `needed` (the worker and the swarm's children inherit it), as far as the
    hard limit lets; below that, say what to change rather than fail at the first socket too many."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        soft = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft != resource.RLIM_INFINITY and soft < needed:
        server.log.warning("open files are limited to %d, below the %d that MAX_WEBSOCKETS and MAX_SESSIONS take: "
                           "raise the hard limit (ulimit -Hn) or lower them", soft, needed)


def on_reload(server):
    """A reload (SIGHUP) reads this file again, threads = 1 included: size the new worker as the first."""
    from config import Settings

    _size_for_limits(server, Settings.from_env().gateway.limits)


def post_fork(server, worker):
    """In the worker, before any of its threads exists: every later thread gets the smaller stack."""
    import threading

    threading.stack_size(THREAD_STACK_BYTES)


def on_exit(server):
    if _local_swarm is not None:
        _local_swarm.stop()
