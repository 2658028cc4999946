"""The ``kvring`` command line."""

from __future__ import annotations

import enum
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from typer.models import OptionInfo

import kvring
from kvring.cli.errors import CommandFailed, run_app
from kvring.common.contract import transfer_config
from kvring.common.units import format_size, parse_size

if TYPE_CHECKING:
    from kvring.cachenode.pool_events import PoolEvents
    from kvring.common.nodetoken import NodeToken
    from kvring.local.cluster import LocalCluster
    from kvring.membership.settings import EtcdSettings

# rich_markup_mode=None: help texts are printed as written (rich markup would eat "[...]"), and
# errors are reported by kvring.cli.errors in one line, never in a box.
app = typer.Typer(help="kvring: a distributed KV cache for LLM serving.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False, rich_markup_mode=None)
bench_app = typer.Typer(help="Benchmarks (each prints a table; --json and --plot write files).",
                        no_args_is_help=True, rich_markup_mode=None)
app.add_typer(bench_app, name="bench")

EtcdOpt = Annotated[str, typer.Option("--etcd", help="etcd endpoints, host:port[,host:port].")]
ClusterOpt = Annotated[str, typer.Option("--cluster", help="Cluster name (a key prefix in etcd).")]
TlsDirOpt = Annotated[Path | None, typer.Option(
    "--tls-dir", envvar="KVRING_TLS_DIR",
    help="The cluster's credentials (ca.crt, tls.crt, tls.key), for a cluster whose nodes require TLS.")]
NodeTokenFileOpt = Annotated[Path | None, typer.Option(
    "--node-token-file", show_default=False,
    help="File holding the cluster's node token, which the nodes' admin ports require for flush, drain and key "
         "queries, read again when it changes (one token per line while it changes: the first is sent, each is "
         "accepted) (default: the KVRING_NODE_TOKEN variable).")]
VerboseOpt = Annotated[bool, typer.Option(
    "--verbose", "-v", help="Log at DEBUG level, and print the traceback of an error (for a bug report).")]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Write results as JSON.")]
PlotOpt = Annotated[Path | None, typer.Option("--plot", help="Write a PNG plot.")]
BenchTlsOpt = Annotated[bool, typer.Option(help="Mutual TLS on the data plane, as `kvring up` runs it (--no-tls: "
                                                "plain TCP, to compare).")]


def _size(value: str, flag: str, *, zero: bool = False) -> int:
    """The size a person wrote for ``flag``, in bytes; positive unless ``zero`` may be meant."""
    try:
        size = parse_size(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=flag) from None
    if size < 0 or (size == 0 and not zero):
        raise typer.BadParameter(f"{value!r}: must be {'0 or more' if zero else 'positive'}, e.g. 4GiB",
                                 param_hint=flag)
    return size


def _port(help: str) -> OptionInfo:
    """A TCP port option (0: any free port)."""
    return typer.Option(help=help, min=0, max=65535)


def _credentials(tls_dir: Path | None):
    """The cluster credentials in ``--tls-dir`` (None without it); a one-line usage error if unusable."""
    from kvring.common.tls import ClusterCredentials, CredentialsError

    try:
        return ClusterCredentials.at(tls_dir) if tls_dir else None
    except CredentialsError as exc:
        raise typer.BadParameter(str(exc), param_hint="--tls-dir") from None


def _node_token(token_file: Path | None) -> NodeToken | None:
    """The node token: ``--node-token-file`` (its lines, followed as the file changes), else
    ``KVRING_NODE_TOKEN``, else None; a one-line usage error for a file that cannot be read, is
    empty or holds a malformed token."""
    import os

    from kvring.common.nodetoken import NodeToken, NodeTokenError

    try:
        if token_file is not None:
            return NodeToken.from_file(token_file)
        token = os.environ.get("KVRING_NODE_TOKEN", "").strip()
        return NodeToken.fixed(token) if token else None
    except NodeTokenError as exc:
        raise typer.BadParameter(str(exc), param_hint="--node-token-file" if token_file else "KVRING_NODE_TOKEN") \
            from None


def _free_port(host: str, port: int, flag: str) -> None:
    """Stop with one line if ``port`` (0: any, always free) cannot be bound on ``host`` (in use, not this
    machine's address), rather than the server failing later with a traceback."""
    import errno
    import socket

    if port == 0:
        return
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do
            s.bind((host, port))
    except socket.gaierror:
        raise CommandFailed(f"cannot serve on {host}:{port}: {host} is not a known host name; check --host") from None
    except OSError as exc:
        if exc.errno == errno.EADDRNOTAVAIL:
            raise CommandFailed(f"cannot serve on {host}:{port}: {host} is not an address of this machine; "
                                "check --host") from None
        raise CommandFailed(f"cannot serve on {host}:{port} ({exc.strerror or exc}): choose another {flag}, "
                            "or stop what is using it") from None


def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _etcd_settings(endpoints: str, cluster: str) -> EtcdSettings:
    """The ``--etcd`` endpoints a person gave, parsed."""
    from kvring.membership.settings import EtcdSettings

    try:
        return EtcdSettings.parse(endpoints, cluster=cluster)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--etcd") from None


def _reachable_etcd(endpoints: str, cluster: str) -> EtcdSettings:
    """The ``--etcd`` a person gave: parsed, and answering (one line and exit 1 otherwise)."""
    from kvring.membership.reach import check_reachable

    settings = _etcd_settings(endpoints, cluster)
    check_reachable(settings)
    return settings


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"kvring {kvring.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print kvring's version and exit.", is_eager=True,
                                          callback=_print_version)] = False,
    verbose: VerboseOpt = False,
) -> None:
    if verbose:
        _logging(True)


@app.command()
def node(
    node_id: Annotated[str, typer.Option("--node-id", help="Stable id; a restarted node takes its old place.")],
    etcd: EtcdOpt,
    memory: Annotated[str, typer.Option("--memory", help="Cache budget, e.g. 4GiB.")] = "1GiB",
    cluster: ClusterOpt = "default",
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    advertise_host: Annotated[str | None, typer.Option(help="Address others reach this node at.")] = None,
    data_port: Annotated[int, _port("TCP port of the data protocol (0: any free port).")] = 0,
    admin_port: Annotated[int, _port("HTTP port for /healthz /readyz /metrics (0: any free port).")] = 0,
    max_chunk_bytes: Annotated[str | None, typer.Option(
        help="Largest chunk accepted (default: 256MiB, or --memory if less).", show_default=False)] = None,
    policy: Annotated[str, typer.Option(help="Eviction policy: lru or fifo.")] = "lru",
    lease_ttl: Annotated[int, typer.Option(help="etcd lease TTL in seconds.", min=1)] = 10,
    handoff: Annotated[bool, typer.Option(help="Move chunks this node no longer owns to their owners, and "
                                                "restore copies its co-owners lack.")] = True,
    repair_rate: Annotated[str, typer.Option(help="Bytes per second of copies restored to co-owners "
                                                  "(0: no limit).")] = "64MiB",
    repair_interval: Annotated[float, typer.Option(help="Seconds between repair passes when the ring "
                                                        "does not change.", min=0.01)] = 60.0,
    tls_dir: TlsDirOpt = None,
    node_token_file: NodeTokenFileOpt = None,
    events: Annotated[bool, typer.Option(help="Publish KV events (vLLM's wire format) of the chunks stored and "
                                              "removed, for KV-aware routers.")] = True,
    events_port: Annotated[int, _port("ZMQ PUB port of the KV events (0: any free port).")] = 0,
    events_replay_port: Annotated[int, _port("ZMQ ROUTER port replaying recent KV-event batches "
                                             "(0: any free port).")] = 0,
    events_topic: Annotated[str, typer.Option(help="Topic frame of every KV-event message.")] = "",
    self_check_interval: Annotated[float, typer.Option(
        help="Seconds between PINGs of its own data port; 3 missed in a row take the node off the ring until "
             "it answers again (0: no check).", min=0)] = 5.0,
    receive_budget: Annotated[str, typer.Option(
        help="Bytes of partly received requests held in all; past it, connections still sending wait.")] = "32MiB",
    receive_timeout: Annotated[float, typer.Option(
        help="Seconds a connection may stay silent in the middle of a request (or of its TLS handshake) "
             "before it is closed.", min=0.01)] = 10.0,
    disk_dir: Annotated[str | None, typer.Option(
        help="Keep every chunk on disk too, in this directory of its own: memory becomes the hot tier, and a "
             "restart with the same --node-id and directory keeps the cache.", show_default=False)] = None,
    disk_capacity: Annotated[str | None, typer.Option(
        help="Disk budget with --disk-dir, e.g. 100GiB (oldest chunks go first past it).",
        show_default=False)] = None,
    disk_sync: Annotated[bool, typer.Option(help="fdatasync each batch of chunks written to disk before "
                                                 "journaling them (off: a power loss may lose more).")] = True,
    disk_write_queue: Annotated[str, typer.Option(
        help="Bytes of chunks waiting for the disk; past it, chunks stay in memory only.")] = "256MiB",
    disk_scrub_rate: Annotated[str, typer.Option(
        help="Bytes a second the scrub reads at most, checking every chunk on disk again in the background "
             "(a corrupt one is dropped and announced removed); 0 turns it off.")] = "16MiB",
    disk_scrub_interval: Annotated[float, typer.Option(
        help="Seconds from the start of one scrub pass over the disk to the next, at least (the first starts "
             "with the node).", min=0)] = 86400.0,
    disk_marks_interval: Annotated[float, typer.Option(
        help="Seconds between saves of which chunks were read from disk (their second chance), while that "
             "changes, so a crash keeps them; 0 saves them at a graceful stop only.", min=0)] = 60.0,
    disk_eviction: Annotated[str, typer.Option(
        help="Past the disk budget the oldest segment goes: second-chance first carries the chunks read from it "
             "since they were written to the newest segment, fifo lets them go too.")] = "second-chance",
    fault_injection: Annotated[bool, typer.Option(
        "--fault-injection", help="Testing only: POST /debug/corrupt?key=HEX from loopback flips a stored byte, "
                                  "POST /debug/stall?seconds=S blocks the data loop, "
                                  "POST /debug/disk-stall?seconds=S stalls the disk tier, "
                                  "POST /debug/signal-on-get?signal=SIGSTOP|SIGKILL signals the node at its next GET, "
                                  "POST /debug/misnumber-on-get?how=swap|repeat|negative|extra misnumbers the next "
                                  "streamed GET's layers.",
        hidden=True)] = False,
    chunk_size: Annotated[int, typer.Option(help="Contract: tokens per chunk.", min=1)] = 256,
    vnodes: Annotated[int, typer.Option(help="Contract: virtual nodes per node (at mean capacity).", min=1)] = 1024,
    replication: Annotated[int, typer.Option(help="Contract: owners per chunk.", min=1)] = 1,
    verbose: VerboseOpt = False,
) -> None:
    """Run one cache node: the TCP data port, the HTTP admin port, and registration in etcd."""
    from kvring.cachenode.disk.tier import DiskConfig
    from kvring.cachenode.node import NodeConfig, run_node
    from kvring.common.contract import Contract
    from kvring.events.publisher import PublisherSettings

    _logging(verbose)
    _free_port(host, data_port, "--data-port")
    _free_port(host, admin_port, "--admin-port")
    if events:
        _free_port(host, events_port, "--events-port")
        _free_port(host, events_replay_port, "--events-replay-port")
    tls = _credentials(tls_dir)
    if (disk_dir is None) != (disk_capacity is None):
        raise typer.BadParameter("--disk-dir and --disk-capacity go together, e.g. --disk-dir /var/lib/kvring "
                                 "--disk-capacity 100GiB")
    try:
        disk = None if disk_dir is None else DiskConfig(
            directory=disk_dir, capacity=_size(disk_capacity, "--disk-capacity"), sync=disk_sync,
            write_queue=_size(disk_write_queue, "--disk-write-queue"),
            scrub_rate=_size(disk_scrub_rate, "--disk-scrub-rate", zero=True), scrub_interval=disk_scrub_interval,
            eviction=disk_eviction, marks_interval=disk_marks_interval)
        config = NodeConfig(
            node_id=node_id, memory=_size(memory, "--memory"), host=host, data_port=data_port,
            admin_port=admin_port, advertise_host=advertise_host,
            max_chunk_bytes=(_size(max_chunk_bytes, "--max-chunk-bytes") if max_chunk_bytes
                             else min(256 << 20, _size(memory, "--memory"))), policy=policy,
            etcd=_etcd_settings(etcd, cluster), lease_ttl=lease_ttl, handoff=handoff,
            repair_rate=_size(repair_rate, "--repair-rate", zero=True),
            repair_interval=repair_interval, self_check_interval=self_check_interval,
            receive_budget=_size(receive_budget, "--receive-budget"), receive_timeout=receive_timeout,
            tls=tls, node_token=_node_token(node_token_file), fault_injection=fault_injection,
            contract=Contract(chunk_size=chunk_size, vnodes=vnodes, replication=replication),
            events=PublisherSettings(host=host, port=events_port, replay_port=events_replay_port,
                                     topic=events_topic) if events else None,
            disk=disk)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if config.node_token is None:
        typer.echo("warning: no node token (--node-token-file or KVRING_NODE_TOKEN): the admin port refuses flush, "
                   "drain and key queries (403)", err=True)
    raise typer.Exit(run_node(config))


@app.command()
def up(
    nodes: Annotated[int, typer.Option("--nodes", help="Number of cache nodes.", min=1)] = 3,
    memory: Annotated[str, typer.Option("--memory", help="Cache budget per node.")] = "1GiB",
    etcd: Annotated[str | None, typer.Option(
        "--etcd", help="Use this etcd (host:port) instead of starting one; it must answer at once.")] = None,
    cluster: ClusterOpt = "default",
    replication: Annotated[int, typer.Option(help="Owners per chunk.", min=1)] = 1,
    demo: Annotated[bool, typer.Option("--demo", help="Run a short workload, then stop.")] = False,
    admin: Annotated[bool, typer.Option(help="Also serve the admin API on loopback.")] = True,
    admin_port: Annotated[int, _port("Admin API port (0: any free port).")] = 0,
    tls: Annotated[bool, typer.Option(help="Generate cluster credentials and require them on the data ports "
                                           "(--no-tls: plain TCP, e.g. for benchmarks).")] = True,
    disk_dir: Annotated[str | None, typer.Option(
        help="Give each node a disk tier in DIR/<node-id> (kept after the run: the next `kvring up` with the "
             "same directory starts warm).", show_default=False)] = None,
    disk_capacity: Annotated[str, typer.Option(help="Disk budget per node with --disk-dir.")] = "10GiB",
) -> None:
    """Start a local cluster (etcd + N nodes + the admin API on loopback) until Ctrl-C, SIGTERM or SIGHUP;
    then stop every process it started and remove its temporary files."""
    import os
    import secrets

    from kvring.common.contract import Contract
    from kvring.local.cluster import LocalCluster
    from kvring.local.rundir import run_directory
    from kvring.local.signals import Stopped

    budget = _size(memory, "--memory")
    if admin:
        _free_port("127.0.0.1", admin_port, "--admin-port")
    if etcd is not None:
        _reachable_etcd(etcd, cluster)
    contract = Contract(replication=replication)
    # The admin token: KVRING_ADMIN_TOKEN if set, else a fresh one printed below.
    token = os.environ.get("KVRING_ADMIN_TOKEN") or secrets.token_hex(16)
    with run_directory("up"):  # etcd's data and the credentials live there; removed however the run ends
        cluster_ = LocalCluster(nodes=nodes, memory=budget, etcd=etcd, cluster=cluster, contract=contract,
                                admin=admin, admin_port=admin_port, admin_token=token, tls=tls,
                                disk=_size(disk_capacity, "--disk-capacity") if disk_dir else 0,
                                disk_root=os.path.abspath(disk_dir) if disk_dir else None)
        try:
            cluster_.start()  # stops what it started if it fails
        except FileNotFoundError as exc:  # no etcd binary
            raise CommandFailed(str(exc)) from None
        from kvring.cachenode.pool_events import PoolEvents

        stream = PoolEvents(cluster_.etcd, cluster)  # the pool's KV events as one stream, for routers
        try:
            try:
                _print_cluster(cluster_, token, stream)
                if demo:
                    from kvring.bench.workload import demo_workload
                    demo_workload(cluster_.etcd, cluster, echo=typer.echo, tls=cluster_.tls)
                    return
                typer.echo("Press Ctrl-C to stop.")
                _watch_nodes(cluster_)
            except (Stopped, KeyboardInterrupt):
                pass  # the way to stop a running cluster (even while it is still being printed): exit 0
        finally:
            _echo_if_possible("stopping ...")
            stream.close()
            cluster_.close()
            _echo_if_possible("stopped.")


def _print_cluster(cluster_: LocalCluster, token: str, stream: PoolEvents) -> None:
    """What ``kvring up`` tells about the cluster it started: addresses, the vLLM flag, the admin API."""
    cluster = cluster_.cluster
    typer.echo(f"kvring cluster {cluster!r} is up: etcd {cluster_.etcd}")
    for n in cluster_.nodes:
        disk = f"  disk {format_size(n.disk_capacity)} in {n.disk_dir}" if n.disk_dir else ""
        typer.echo(f"  {n.node_id}: data {n.data_addr}  admin {n.admin_addr}/metrics  memory {format_size(n.memory)}"
                   f"{disk}")
    tls_extra = {"tls_dir": str(cluster_.tls.directory)} if cluster_.tls is not None else {}
    transfer = json.dumps(transfer_config(cluster_.etcd, cluster, **tls_extra))
    typer.echo("Point vLLM at it:")
    typer.echo(f"  vllm serve MODEL --kv-transfer-config '{transfer}'")
    env = f"KVRING_ETCD={cluster_.etcd} KVRING_CLUSTER={cluster}" + (
        f" KVRING_TLS_DIR={cluster_.tls.directory}" if cluster_.tls is not None else "")
    typer.echo(f"  (or {env} with an empty kv_connector_extra_config)")
    if cluster_.tls is not None:
        typer.echo(f"The data ports require the cluster's credentials in {cluster_.tls.directory} (--tls-dir); the "
                   f"admin ports serve HTTPS under its CA (curl --cacert {cluster_.tls.ca}) and want its client "
                   "certificate for flush, drain and key queries (--no-tls: plain TCP and HTTP)")
    typer.echo(f"The nodes' admin ports need the node token for flush, drain and key queries: "
               f"--node-token-file {cluster_.node_token_file} (or KVRING_NODE_TOKEN=$(cat "
               f"{cluster_.node_token_file}))")
    typer.echo(f"KV events of the whole pool, as one worker for a KV-aware router: {stream.events_addr} "
               f"(replay {stream.replay_addr})")
    typer.echo(f"Inspect: kvring ring --etcd {cluster_.etcd} --cluster {cluster}")
    if cluster_.admin is not None:
        typer.echo(f"Admin API: {cluster_.admin.url} (docs {cluster_.admin.url}/docs); drain and flush need "
                   f"'Authorization: Bearer {token}'")


def _watch_nodes(cluster_: LocalCluster) -> None:
    """Until a signal ends it: warn once about each node that exits."""
    exited: set[str] = set()
    while True:
        for n in cluster_.nodes:
            if n.node_id not in exited and n.proc.poll() is not None:
                exited.add(n.node_id)
                typer.echo(f"warning: {n.node_id} exited with code {n.proc.returncode}", err=True)
        time.sleep(0.2)


def _echo_if_possible(text: str) -> None:
    """After SIGHUP the terminal is gone and writing to it fails; the cleanup must go on regardless."""
    try:
        typer.echo(text)
    except OSError:
        pass


@app.command()
def demo(
    layers: Annotated[int, typer.Option(help="Layers of the random Llama written for the demo.", min=1)] = 6,
    hidden: Annotated[int, typer.Option(help="Hidden size of that model.", min=1)] = 1024,
    prefix_tokens: Annotated[int, typer.Option(help="Tokens of the shared prefix.", min=1)] = 3072,
    suffix_tokens: Annotated[int, typer.Option(help="Tokens of each prompt's own part.", min=1)] = 1024,
    prompts: Annotated[int, typer.Option(help="Prompts in the workload.", min=1)] = 3,
    mode: Annotated[str, typer.Option(help="Connector load mode: layerwise or bulk.")] = "layerwise",
    plot: PlotOpt = None,
    json_out: JsonOpt = None,
    dtype: Annotated[str, typer.Option(help="Model dtype: float32 (exact comparisons) or bfloat16.")] = "float32",
    tls: BenchTlsOpt = True,
) -> None:
    """Two vLLM instances share prefixes through a local cluster; B loads what A computed. Its model, logs and
    processes live in a temporary directory removed at the end (also on Ctrl-C, SIGTERM or SIGHUP)."""
    from kvring.bench.demo import run_demo

    if mode not in ("layerwise", "bulk"):
        raise typer.BadParameter(f"{mode!r}: use layerwise or bulk", param_hint="--mode")
    if dtype not in ("float32", "bfloat16"):
        raise typer.BadParameter(f"{dtype!r}: use float32 or bfloat16", param_hint="--dtype")
    result = run_demo(layers, hidden, prefix_tokens, suffix_tokens, prompts, mode, plot, json_out, dtype, tls)
    if not all(r["identical"] for r in result["rows"]):
        raise typer.Exit(1)


@app.command()
def ring(
    etcd: EtcdOpt,
    cluster: ClusterOpt = "default",
    key: Annotated[list[str] | None, typer.Option("--key", help="Show the owners of this key (hex, or text).")] = None,
    tls_dir: TlsDirOpt = None,
) -> None:
    """Show the ring: members, epoch, balance, and the owners of given keys."""
    from rich.console import Console
    from rich.table import Table

    from kvring.cachenode.client import ClusterClient

    console = Console()
    tls = _credentials(tls_dir)
    _reachable_etcd(etcd, cluster)
    with ClusterClient(etcd, cluster=cluster, contract_wait=0, tls=tls) as client:  # inspecting: no contract wait
        r = client.ring
        shares = r.shares()
        stats = client.stats()
        total_cap = sum(r.weights.values()) or 1
        table = Table(title=f"cluster {cluster!r}: epoch {r.epoch}, {len(r)} nodes, vnodes {r.vnodes}, "
                            f"replication {r.replication}, balance {r.balance():.3f} (max/mean)")
        for col in ("node", "state", "data address", "capacity", "used", "chunks", "ring share", "target"):
            table.add_column(col, justify="right" if col not in ("node", "state", "data address") else "left")
        for node_id, rec in sorted(client.members.items()):
            st = stats.get(node_id, {})
            table.add_row(node_id, rec.state, rec.data_addr, format_size(rec.capacity),
                          format_size(st["used"]) if "used" in st else "?", str(st.get("chunks", "?")),
                          f"{shares.get(node_id, 0):.2%}", f"{rec.capacity / total_cap:.2%}")
        console.print(table)
        for k in key or []:
            try:
                raw = bytes.fromhex(k)
            except ValueError:
                raw = k.encode()
            console.print(f"key {raw.hex()}: owners {', '.join(client.owners(raw)) or '(none)'}")


@bench_app.command("data-plane")
def bench_data_plane(
    etcd: Annotated[str | None, typer.Option(
        "--etcd", help="Measure the running cluster at this etcd instead of starting local ones (--nodes is then "
                       "ignored).")] = None,
    cluster: ClusterOpt = "default",
    nodes: Annotated[str, typer.Option(help="Local kvring clusters to start and compare, by node count.")] = "1,3",
    peers: Annotated[str, typer.Option(
        help="Systems to compare with: tcp (plain socket, the loopback ceiling), zmq, redis, mooncake; one left "
             "out when it cannot run here, with a line saying why.")] = "tcp,zmq,redis,mooncake",
    repetitions: Annotated[int, typer.Option(
        help="Measured repetitions (after a warm-up), every system in each, interleaved.", min=1)] = 20,
    batch: Annotated[int, typer.Option(help="Chunks per request.", min=1)] = 8,
    json_out: JsonOpt = None,
    plot: PlotOpt = None,
    quick: Annotated[bool, typer.Option(help="Smoke test: 32-token chunks, 2 repetitions of 2 chunks, 20 lookup "
                                             "samples (ignores --repetitions and --batch).")] = False,
) -> None:
    """PUT/GET throughput and existence-check latency of kvring (1 and 3 nodes) vs a plain TCP socket, raw ZMQ,
    Redis and Mooncake Store, interleaved in one run."""
    from kvring.bench.dataplane import BenchError, DataPlaneSettings, run_data_plane_bench

    try:
        counts = tuple(int(n) for n in nodes.split(","))
    except ValueError:
        raise typer.BadParameter(f"{nodes!r} is not a comma-separated list of node counts, e.g. 1,3",
                                 param_hint="--nodes") from None
    common = {"etcd": etcd, "cluster": cluster, "nodes": counts,
              "peers": tuple(p.strip() for p in peers.split(",") if p.strip())}
    try:
        settings = DataPlaneSettings.quick_run(**common) if quick else DataPlaneSettings(
            **common, repetitions=repetitions, batch=batch)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if etcd is not None:
        _reachable_etcd(etcd, cluster)
    try:
        run_data_plane_bench(settings, json_out, plot)
    except BenchError as exc:
        raise CommandFailed(f"bench data-plane stopped: {exc}") from None


def _prompt_sizes(tokens: str, example: str) -> list[int]:
    """``--tokens``: comma-separated prompt lengths, each with a whole chunk and more."""
    try:
        sizes = [int(t) for t in tokens.split(",")]
    except ValueError:
        raise typer.BadParameter(f"{tokens!r} is not a comma-separated list of token counts, e.g. {example}",
                                 param_hint="--tokens") from None
    if any(n < 300 for n in sizes):
        raise typer.BadParameter("each prompt needs at least 300 tokens (one whole chunk and more)",
                                 param_hint="--tokens")
    return sizes


class BenchDtype(str, enum.Enum):
    auto = "auto"
    bfloat16 = "bfloat16"
    float32 = "float32"


@bench_app.command("e2e")
def bench_e2e(
    tokens: Annotated[str, typer.Option(help="Prompt lengths, comma-separated.")] = "1024,4096,8192",
    layers: Annotated[int, typer.Option(help="Layers of the random Llama.", min=1)] = 6,
    hidden: Annotated[int, typer.Option(help="Hidden size of the random Llama (8 heads of 128).", min=128)] = 1024,
    intermediate: Annotated[int, typer.Option(help="MLP width of the random Llama.", min=1)] = 11008,
    memory: Annotated[str, typer.Option("--memory", help="Cache budget per node.")] = "2GiB",
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel size to compare with TP 1 (1: the load modes "
                                                 "instead); the model's 4 KV heads must split over it.",
                                    min=1)] = 1,
    tls: BenchTlsOpt = True,
    dtype: Annotated[BenchDtype, typer.Option(
        "--dtype", help="The model's dtype (and its KV cache's). auto: bfloat16 where the CPU computes it natively "
             "(AVX-512 BF16, AMX), else float32; float32 with --tp.")] = BenchDtype.auto,
    repetitions: Annotated[int | None, typer.Option(
        help="Loads of each prompt per load mode, medians reported (default 5; not with --tp).", min=1)] = None,
    json_out: JsonOpt = None,
    plot: PlotOpt = None,
) -> None:
    """Time to first token with real vLLM: loaded from a 3-node cluster (layerwise, bulk, async) vs recomputed;
    with --tp N, TP N and TP 1 instances loading what TP N stored."""
    from kvring.bench.e2e import REPETITIONS, run_bench_e2e
    from kvring.bench.e2e_tp import KV_HEADS, run_bench_e2e_tp
    from kvring.engine.run import native_dtype

    sizes = _prompt_sizes(tokens, example="1024,4096")
    if tp > 1:
        if repetitions is not None:
            raise typer.BadParameter("--tp compares TP sizes with one load each; leave it out",
                                     param_hint="--repetitions")
        if KV_HEADS % tp:
            raise typer.BadParameter(f"the bench's model has {KV_HEADS} KV heads, which {tp} ranks cannot split; "
                                     "use 2 or 4", param_hint="--tp")
        run_bench_e2e_tp(tp, sizes, layers=layers, hidden=hidden, intermediate=intermediate,
                         memory=_size(memory, "--memory"), json_out=json_out, plot=plot, tls=tls,
                         dtype="float32" if dtype is BenchDtype.auto else dtype.value)
        return
    native = native_dtype()
    chosen = native if dtype is BenchDtype.auto else dtype.value
    if chosen == "bfloat16" and native != "bfloat16":
        typer.echo("warning: this CPU has no native bfloat16 (AVX-512 BF16 or AMX): a recompute runs about 100x "
                   "slower than in float32 and may outlast vLLM's step timeout", err=True)
    run_bench_e2e(sizes, layers=layers, hidden=hidden, intermediate=intermediate, memory=_size(memory, "--memory"),
                  json_out=json_out, plot=plot, tls=tls, dtype=chosen, repetitions=repetitions or REPETITIONS)


@bench_app.command("shapes")
def bench_shapes(
    tokens: Annotated[str, typer.Option(help="Prompt lengths, comma-separated.")] = "2048,4096",
    repetitions: Annotated[int, typer.Option(help="Recompute and load pairs per prompt, interleaved.", min=1)] = 3,
    layers: Annotated[int, typer.Option(help="Layers of every model (at least 6: the hybrid's sixth layer is its "
                                             "full-attention one).", min=6)] = 6,
    hidden: Annotated[int, typer.Option(help="Hidden size of every model (8 heads).", min=64)] = 1024,
    memory: Annotated[str, typer.Option("--memory", help="Cache budget per node.")] = "2GiB",
    json_out: JsonOpt = None,
    plot: PlotOpt = None,
) -> None:
    """Stored bytes per token and time to first token, loaded vs recomputed, of a Llama, an MLA model
    (DeepSeek-V2), a sliding-window hybrid (Gemma-3-like) and a model with recurrent state (Qwen3-Next) of the
    same size, through one local cluster."""
    from kvring.bench.shapes import run_bench_shapes

    sizes = _prompt_sizes(tokens, example="2048,4096")
    result = run_bench_shapes(sizes, layers=layers, hidden=hidden, repetitions=repetitions,
                              memory=_size(memory, "--memory"), json_out=json_out, plot=plot)
    if not all(r["identical"] for s in result["shapes"].values() for r in s["rows"]):
        raise typer.Exit(1)


@bench_app.command("gpu")
def bench_gpu(
    chunks: Annotated[int, typer.Option(help="Chunks of 256 tokens a step loads and saves.", min=1)] = 16,
    tokens: Annotated[int, typer.Option(help="New tokens of the stand-in forward (an 8B layer's projections and "
                                             "attention per layer).", min=1)] = 4096,
    layout: Annotated[str, typer.Option(help="vLLM's physical KV cache layout: LBNHC (NHD, FlashAttention's), "
                                             "LBHNC (HND), LHBNC, BLHNC, BLNHC or BHLNC.")] = "LBNHC",
    repetitions: Annotated[int, typer.Option(help="Interleaved repetitions after a warm-up.", min=1)] = 7,
    budget: Annotated[float, typer.Option(help="Start no repetition after this many seconds, once two are in "
                                               "(0: no limit).", min=0)] = 0.0,
    json_out: JsonOpt = None,
    plot: PlotOpt = None,
) -> None:
    """On a CUDA device: the connector's layerwise loads (host to device) and saves (device to host) with a
    Llama-3.1-8B-shaped cache against plain pinned copies, and a stand-in forward with and without a load."""
    from kvring.bench.gpu import LAYOUTS, GpuSettings, run_bench_gpu

    if layout not in LAYOUTS:
        raise typer.BadParameter(f"{layout!r} is not one of vLLM's layouts: {', '.join(LAYOUTS)}",
                                 param_hint="--layout")
    run_bench_gpu(GpuSettings(chunks=chunks, tokens=tokens, layout=layout, repetitions=repetitions, budget_s=budget),
                  json_out=json_out, plot=plot)


@bench_app.command("miss")
def bench_miss(
    prompts: Annotated[int, typer.Option(help="Prompts per batch (one generate call).", min=1)] = 32,
    tokens: Annotated[int, typer.Option(help="Tokens per prompt (at least one 256-token chunk).", min=256)] = 1024,
    repetitions: Annotated[int, typer.Option(help="Batches per engine, alternating the engines.", min=1)] = 3,
    layers: Annotated[int, typer.Option(help="Layers of the random Llama.", min=1)] = 6,
    hidden: Annotated[int, typer.Option(help="Hidden size of the random Llama (8 heads of 128).", min=128)] = 1024,
    intermediate: Annotated[int, typer.Option(help="MLP width of the random Llama.", min=1)] = 11008,
    memory: Annotated[str, typer.Option("--memory", help="Cache budget per node.")] = "2GiB",
    omp_bind: Annotated[str, typer.Option(help="same: both engines' threads on every CPU (compares kvring alone); "
                                               "vllm: vLLM's auto binding, which keeps one more core back when "
                                               "a KV connector is configured.")] = "same",
    quick: Annotated[bool, typer.Option(help="A toy model and 2 batches of 8 x 512 tokens (smoke test); "
                                              "ignores the size options.")] = False,
    tls: BenchTlsOpt = True,
    json_out: JsonOpt = None,
    plot: PlotOpt = None,
) -> None:
    """At 0 % hits: prompt throughput of one vLLM engine with kvring vs without a connector, and the
    share of the run its scheduler hooks took."""
    import dataclasses

    from kvring.bench.miss import OMP_BINDS, MissSettings, run_bench_miss

    if omp_bind not in OMP_BINDS:
        raise typer.BadParameter(f"{omp_bind!r}: choose one of {', '.join(OMP_BINDS)}", param_hint="--omp-bind")
    settings = MissSettings.quick(omp_bind) if quick else MissSettings(
        prompts=prompts, tokens=tokens, repetitions=repetitions, layers=layers, hidden=hidden,
        intermediate=intermediate, memory=_size(memory, "--memory"), omp_bind=omp_bind)
    run_bench_miss(dataclasses.replace(settings, tls=tls), json_out=json_out, plot=plot)


@bench_app.command("slow-node")
def bench_slow_node(
    stop_ms: Annotated[float, typer.Option(help="The slowed node is stopped (SIGSTOP) this long ...", min=1)] = 300.0,
    run_ms: Annotated[float, typer.Option(help="... then runs this long, over and over.", min=1)] = 30.0,
    lookup_deadline_ms: Annotated[float | None, typer.Option(
        help="The connector's lookup_deadline_ms [default: the connector's].", min=0)] = None,
    quick: Annotated[bool, typer.Option(help="A toy model and fewer, shorter prompts (smoke test).")] = False,
    tls: BenchTlsOpt = True,
    json_out: JsonOpt = None,
    plot: PlotOpt = None,
) -> None:
    """Async loads while one node is slowed: what the connector decided per prompt (loaded, abandoned
    at its deadline, refused by admission) and the time to first token, healthy / slowed / recovered."""
    import dataclasses

    from kvring.bench.slow_node import SlowNodeSettings, run_bench_slow_node

    settings = SlowNodeSettings.quick() if quick else SlowNodeSettings()
    run_bench_slow_node(dataclasses.replace(settings, stop_ms=stop_ms, run_ms=run_ms, lookup_deadline_ms=lookup_deadline_ms,
                                            tls=tls),
                        json_out=json_out, plot=plot)


@bench_app.command("membership")
def bench_membership(
    clients: Annotated[int, typer.Option(help="Idle clients (ClusterClient), each with its own etcd connection.",
                                         min=1)] = 50,
    nodes: Annotated[int, typer.Option(help="Node processes.", min=1)] = 20,
    window: Annotated[float, typer.Option(help="Seconds each idle window lasts.", min=1)] = 20.0,
    repetitions: Annotated[int, typer.Option(help="Windows of each kind (alternating).", min=1)] = 3,
    json_out: JsonOpt = None,
    plot: PlotOpt = None,
) -> None:
    """etcd messages per second per idle client (etcd's own counters, the nodes' share subtracted),
    and how long a node's join takes to reach every client."""
    from kvring.bench.membership import MembershipSettings, run_bench_membership

    run_bench_membership(MembershipSettings(clients=clients, nodes=nodes, window=window, repetitions=repetitions),
                         json_out=json_out, plot=plot)


@bench_app.command("repair")
def bench_repair(
    chunks: Annotated[int, typer.Option(help="Chunks written (replication 2).", min=1)] = 1500,
    chunk_bytes: Annotated[str, typer.Option(help="Bytes per chunk.")] = "256KiB",
    repetitions: Annotated[int, typer.Option(help="Nodes killed and restarted empty, in turn, per rate.",
                                             min=1)] = 3,
    repair_rate: Annotated[list[str] | None, typer.Option(
        help="The nodes' --repair-rate; give it again for more runs [default: 64MiB and 0 (no limit)].")] = None,
    json_out: JsonOpt = None,
    plot: PlotOpt = None,
) -> None:
    """Time and rate of restoring 2 copies after a node comes back empty, and the reads served meanwhile."""
    from kvring.bench.repair import RepairSettings, run_bench_repair

    rates = tuple(_size(r, "--repair-rate") for r in repair_rate) if repair_rate else RepairSettings.rates
    run_bench_repair(RepairSettings(chunks=chunks, chunk_bytes=_size(chunk_bytes, "--chunk-bytes"),
                                    repetitions=repetitions, rates=rates), json_out=json_out, plot=plot)


@bench_app.command("tls")
def bench_tls(
    repetitions: Annotated[int, typer.Option(help="Interleaved rounds per size.", min=1)] = 15,
    json_out: JsonOpt = None,
    plot: PlotOpt = None,
) -> None:
    """PUT and GET throughput (3 MiB and 32 MiB chunks) of a node requiring mutual TLS, next to a plain one, the
    bare ssl loop and a raw TCP socket, interleaved."""
    from kvring.bench.tls import TlsSettings, run_bench_tls

    run_bench_tls(TlsSettings(repetitions=repetitions), json_out=json_out, plot=plot)


@bench_app.command("reads")
def bench_reads(
    tokens: Annotated[int, typer.Option(help="Prompt length (whole 256-token chunks).", min=256)] = 4096,
    repetitions: Annotated[int, typer.Option(help="Interleaved rounds.", min=1)] = 9,
    json_out: JsonOpt = None,
    plot: PlotOpt = None,
) -> None:
    """A prompt's load from 3 TLS nodes into a paged host cache, read on the caller's thread and by a reader thread
    per node, next to the bare TLS loop from 1 and 3 servers, interleaved (no vLLM needed)."""
    from kvring.bench.reads import ReadsSettings, run_bench_reads
    from kvring.bench.system import BenchError

    if tokens % 256:
        raise typer.BadParameter(f"{tokens} is not a whole number of 256-token chunks", param_hint="--tokens")
    try:
        run_bench_reads(ReadsSettings(tokens=tokens, repetitions=repetitions), json_out=json_out, plot=plot)
    except BenchError as exc:
        raise CommandFailed(f"bench reads stopped: {exc}") from None


@bench_app.command("disk")
def bench_disk(
    parts: Annotated[str, typer.Option(help="What to measure, comma-separated: throughput (tier GB/s vs the "
                                            "device's), rebuild (warm restart), trace (hit rate, memory only vs "
                                            "memory + disk, fifo vs second chance), ttft (vLLM, chunks from disk).")]
        = "throughput,rebuild,trace,ttft",
    repetitions: Annotated[int, typer.Option(help="Interleaved device and tier rounds.", min=1)] = 5,
    tier_bytes: Annotated[str, typer.Option(help="Bytes PUT and read back per tier round (and the device's test "
                                                 "file).")] = "1GiB",
    chunk_bytes: Annotated[str, typer.Option(help="Bytes per chunk in the tier rounds (32 layers).")] = "4MiB",
    max_chunks: Annotated[int | None, typer.Option(
        help="Cap the rebuild's chunk counts (10k, 100k, 1M) at this many.", min=1)] = None,
    restarts: Annotated[int, typer.Option(help="Cold restarts per chunk count.", min=1)] = 3,
    trace_file: Annotated[Path | None, typer.Option(
        "--trace", help="Trace to replay (Mooncake format) [default: shared/traces/conversation_trace.jsonl beside "
                        "the checkout].", exists=True, dir_okay=False)] = None,
    limit: Annotated[int, typer.Option(help="Requests of the trace replayed.", min=1)] = 2000,
    memory: Annotated[str, typer.Option("--memory", help="Memory per node in the trace replays.")] = "16MiB",
    small_disk: Annotated[str, typer.Option(
        help="Disk per node of the trace replays where eviction matters (fifo vs second chance).")] = "128MiB",
    large_disk: Annotated[str, typer.Option(help="Disk per node of the trace replay with a large disk.")] = "1GiB",
    tokens: Annotated[int, typer.Option(help="Prompt length of the time-to-first-token part.", min=300)] = 4096,
    json_out: JsonOpt = None,
    plot: PlotOpt = None,
) -> None:
    """The disk tier: GB/s beside the device's own, index rebuild and restart-to-first-hit for 10k-1M chunks,
    a trace's hit rate with memory only vs memory + disk, and vLLM's time to first token from disk."""
    from kvring.bench.disk import DiskBenchSettings, default_trace, run_bench_disk

    size = _size(tier_bytes, "--tier-bytes")
    try:
        settings = DiskBenchSettings(
            parts=tuple(p.strip() for p in parts.split(",") if p.strip()), repetitions=repetitions,
            device_bytes=size, tier_bytes=size, chunk_bytes=_size(chunk_bytes, "--chunk-bytes"),
            max_chunks=max_chunks, restarts=restarts, trace=trace_file or default_trace(), trace_limit=limit,
            trace_memory=_size(memory, "--memory"), trace_small_disk=_size(small_disk, "--small-disk"),
            trace_disk=_size(large_disk, "--large-disk"), tokens=tokens)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    run_bench_disk(settings, json_out=json_out, plot=plot)


@app.command()
def trace(
    file: Annotated[Path, typer.Argument(help="Trace in Mooncake FAST'25 format (JSON lines).", exists=True,
                                         dir_okay=False)],
    nodes: Annotated[int, typer.Option(help="Cache nodes.", min=1)] = 3,
    memory: Annotated[str, typer.Option(help="Memory per node.")] = "1GiB",
    etcd: Annotated[str | None, typer.Option("--etcd", help="Use a running cluster (default: start one).")] = None,
    limit: Annotated[int | None, typer.Option(help="Replay only the first N requests.", min=1)] = None,
    block_bytes: Annotated[str, typer.Option(help="Bytes stored per 512-token block.")] = "64KiB",
    json_out: JsonOpt = None,
    plot: PlotOpt = None,
) -> None:
    """Replay a request trace against a cluster: hit rate vs an ideal LRU, balance of bytes and load."""
    from kvring.bench.trace import run_trace

    budget, block = _size(memory, "--memory"), _size(block_bytes, "--block-bytes")
    if etcd is not None:
        _reachable_etcd(etcd, "default")
    run_trace(file, nodes=nodes, memory=budget, etcd=etcd, limit=limit, block_bytes=block, json_out=json_out,
              plot=plot)


@app.command()
def drain(
    admin_url: Annotated[str | None, typer.Option(
        "--admin", help="The node's admin URL, e.g. https://127.0.0.1:8080 (a pod's preStop hook; http:// "
                        "for a node without TLS).")] = None,
    etcd: Annotated[str | None, typer.Option("--etcd", help="etcd endpoints, to drain --node through etcd.")] = None,
    cluster: ClusterOpt = "default",
    node_id: Annotated[str | None, typer.Option("--node", help="Node id to drain (with --etcd).")] = None,
    wait: Annotated[float, typer.Option("--wait", help="Seconds to wait for 'drained' (0: do not wait).",
                                        min=0)] = 0,
    cancel: Annotated[bool, typer.Option("--cancel", help="Withdraw the drain request instead.")] = False,
    node_token_file: NodeTokenFileOpt = None,
    tls_dir: TlsDirOpt = None,
) -> None:
    """Drain a node: it leaves the ring and hands every chunk to its new owners, then reports drained."""
    from kvring.cli.drain import drain_via_admin, drain_via_etcd

    if (admin_url is None) == (etcd is None):
        raise typer.BadParameter("give either --admin URL (drain the node behind it) or --etcd with --node")
    creds = _credentials(tls_dir)
    tls = creds.client_context() if creds is not None else None
    if admin_url is not None:
        node_token = _node_token(node_token_file)
        drain_via_admin(admin_url, wait, cancel, typer.echo, token=node_token.presented() if node_token else None,
                        tls=tls)
    else:
        if not node_id:
            raise typer.BadParameter("--etcd needs --node NODE_ID", param_hint="--node")
        drain_via_etcd(_reachable_etcd(etcd, cluster), node_id, wait, cancel, typer.echo, tls=tls)


@app.command()
def operator(
    namespace: Annotated[list[str] | None, typer.Option(
        "--namespace", "-n", help="Serve CacheClusters in this namespace (repeat; globs allowed). Default: all.")] = None,
    status_interval: Annotated[float, typer.Option(help="Seconds between status updates of each CacheCluster.",
                                                   min=0.1)] = 10.0,
    etcd_timeout: Annotated[float, typer.Option(help="Seconds per etcd request.", min=0.1)] = 2.0,
    api_timeout: Annotated[float, typer.Option(
        help="Seconds a Kubernetes API request may take before the operator counts it failed and retries.",
        min=0.1)] = 30.0,
    liveness: Annotated[str | None, typer.Option(
        help="Serve a liveness probe here, e.g. http://0.0.0.0:8081/healthz.")] = None,
    own_namespace: Annotated[str | None, typer.Option(
        "--own-namespace", envvar="POD_NAMESPACE", show_default=False,
        help="The namespace the operator's pod runs in (the chart sets POD_NAMESPACE): CacheClusters' "
             "NetworkPolicies admit its pods from there.")] = None,
    metrics_port: Annotated[int, typer.Option(
        help="Serve Prometheus /metrics on this port (all addresses); 0: off.", min=0, max=65535)] = 0,
    verbose: VerboseOpt = False,
) -> None:
    """Run the Kubernetes operator for CacheCluster resources (in a pod: its service account; else $KUBECONFIG)."""
    import asyncio

    from kvring.operator.config import OperatorConfig
    from kvring.operator.kube import KubeError, load_configuration
    from kvring.operator.main import run

    try:  # no credentials at all: one line now, rather than kopf retrying (with a traceback) every minute
        asyncio.run(load_configuration())
    except KubeError as exc:
        raise CommandFailed(str(exc)) from None
    run(OperatorConfig(namespaces=tuple(namespace or ()), status_interval=status_interval,
                       etcd_timeout=etcd_timeout, api_timeout=api_timeout, liveness_endpoint=liveness,
                       own_namespace=own_namespace or None, metrics_port=metrics_port),
        verbose=verbose)


@app.command()
def admin(
    etcd: EtcdOpt,
    cluster: ClusterOpt = "default",
    host: Annotated[str, typer.Option(help="Address to bind (0.0.0.0 inside a pod).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to serve on.", min=1, max=65535)] = 8000,
    token: Annotated[str | None, typer.Option(
        "--token", envvar="KVRING_ADMIN_TOKEN", show_default=False,
        help="Bearer token for drain and flush (prefer the KVRING_ADMIN_TOKEN variable: a command line is "
             "visible to other users). Without one those endpoints are off.")] = None,
    node_token_file: NodeTokenFileOpt = None,
    tls_dir: TlsDirOpt = None,
    node_timeout: Annotated[float, typer.Option(help="Seconds to wait for a node's /stats.", min=0.01)] = 2.0,
    verbose: VerboseOpt = False,
) -> None:
    """Serve the cluster admin API (FastAPI; OpenAPI docs at /docs)."""
    import uvicorn

    from kvring.admin import AdminSettings, create_app

    _logging(verbose)
    _free_port(host, port, "--port")
    try:
        settings = AdminSettings(etcd=_etcd_settings(etcd, cluster), token=token or None,
                                 node_token=_node_token(node_token_file), tls=_credentials(tls_dir),
                                 node_timeout=node_timeout)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    typer.echo(f"kvring admin API for cluster {cluster!r} on http://{host}:{port} (docs /docs); drain and flush "
               + ("need the bearer token" if settings.token else "are off: set KVRING_ADMIN_TOKEN to enable them"),
               err=True)
    if settings.node_token is None:
        typer.echo("warning: no node token (--node-token-file or KVRING_NODE_TOKEN): the nodes refuse this admin's "
                   "key queries and flushes, so lookup, key owners and flush answer 503", err=True)
    uvicorn.run(create_app(settings), host=host, port=port, log_level="debug" if verbose else "warning")


@app.command()
def events(
    etcd: EtcdOpt,
    cluster: ClusterOpt = "default",
    host: Annotated[str, typer.Option(help="Address to bind (0.0.0.0 inside a pod).")] = "127.0.0.1",
    advertise_host: Annotated[str | None, typer.Option(
        help="Address routers reach the stream at, recorded in etcd and printed (default: --host); with --host "
             "0.0.0.0, give e.g. the stream's Service name.", show_default=False)] = None,
    port: Annotated[int, _port("ZMQ PUB port of the pool's KV events (0: any free port).")] = 5557,
    replay_port: Annotated[int, _port("ZMQ ROUTER port replaying the pool stream's recent batches.")] = 5558,
    topic: Annotated[str, typer.Option(help="Topic frame of every KV-event message.")] = "",
    medium: Annotated[str, typer.Option(help="The tier every event names (vLLM's CPU offload says CPU).")] = "CPU",
    verbose: VerboseOpt = False,
) -> None:
    """Publish the pool's KV events as one stream (one worker for a KV-aware router), until Ctrl-C or SIGTERM."""
    from kvring.cachenode.pool_events import PoolEvents
    from kvring.events.publisher import PublisherSettings
    from kvring.events.relay import RelaySettings
    from kvring.local.signals import Stopped, stop_on_signals

    _logging(verbose)
    try:
        settings = RelaySettings(publisher=PublisherSettings(host=host, port=port, replay_port=replay_port,
                                                             topic=topic, xpub=True),
                                 medium=medium, advertise_host=advertise_host)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    _free_port(host, port, "--port")
    _free_port(host, replay_port, "--replay-port")
    _etcd_settings(etcd, cluster)  # a malformed --etcd is refused here, with the flag named
    if advertise_host is None and host in ("0.0.0.0", "::"):
        typer.echo(f"warning: --host {host} without --advertise-host: etcd records tcp://{host}:..., which no router "
                   "can reach; give the address routers use", err=True)
    stream = PoolEvents(etcd, cluster, settings)
    typer.echo(f"kvring pool events of cluster {cluster!r}: {stream.events_addr} (replay {stream.replay_addr})")
    try:
        with stop_on_signals():
            while True:
                time.sleep(1)
    except (Stopped, KeyboardInterrupt):
        pass
    finally:
        stream.close()


def main(args: list[str] | None = None) -> int:
    """``kvring ...``: the exit status; every error is one line on stderr (``kvring.cli.errors``)."""
    return run_app(app, args)


