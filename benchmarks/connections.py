"""Connections that never finish, clients that never read, and the log they cost (issue 30, items 4
and the small 6), measured on `minivllm serve` in a subprocess with a low file-descriptor limit.

    python benchmarks/connections.py                         # this tree
    python benchmarks/connections.py --src /work/main/src --label main   # another tree (before)

Scenarios, each against a fresh server (RLIMIT_NOFILE --fd-limit, 1024 by default):
- idle: `--idle` sockets (half send nothing, half half a header) held open for `--window`
  seconds; /health probed at set times (status or "hang", latency); the server's log lines and
  bytes meanwhile;
- no-reader: one client streams n=16, logprobs, echo, 400 tokens and reads nothing for `--window`
  seconds: bytes stuck in kernel buffers (ss), the server's RSS, running requests and KV blocks;
- mid-body: a client that sends half its body and closes: the server's log lines;
- long-url: a GET with a 100 KB path: the longest log line.
Prints a table and merges {label: results} into benchmarks/results/connections.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_str, machine_record  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "connections.json"
PROBES = (1, 5, 10, 20, 35)  # seconds after the idle sockets opened


class Server:
    """`minivllm serve` from `src`, its stderr (uvicorn's log, access log included) in a file."""

    def __init__(self, src: str, port: int, fd_limit: int, log: Path, extra: list[str]) -> None:
        self.url, self.log = f"http://127.0.0.1:{port}", log
        env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}

        def low_fd_limit() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit))

        self.process = subprocess.Popen(
            [sys.executable, "-m", "minivllm.cli", "serve", "--port", str(port), *extra],
            env=env,
            stdout=log.open("wb"),  # uvicorn's access log goes to stdout, the rest to stderr
            stderr=subprocess.STDOUT,
            preexec_fn=low_fd_limit,
        )
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert self.process.poll() is None and time.monotonic() < deadline, "no server"
            time.sleep(0.2)

    def log_size(self) -> tuple[int, int]:
        data = self.log.read_bytes()
        return data.count(b"\n"), len(data)

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024

    def stats(self) -> dict:
        return httpx.get(self.url + "/stats", timeout=5).json()

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def probe(url: str) -> dict:
    start = time.monotonic()
    try:
        status = httpx.get(url + "/health", timeout=5).status_code
    except httpx.HTTPError as error:
        status = type(error).__name__
    return {"status": status, "seconds": round(time.monotonic() - start, 3)}


def idle_sockets(server: Server, count: int, window: float) -> dict:
    lines0, bytes0 = server.log_size()
    sockets, start = [], time.monotonic()
    for _ in range(count):
        sock = socket.socket()
        sock.setblocking(False)
        try:
            sock.connect(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
        except BlockingIOError:
            pass
        sockets.append(sock)
    time.sleep(0.2)
    for sock in sockets[::2]:  # half of them: half a header
        try:
            sock.send(b"GET /health HTTP/1.1\r\nhost: x\r\n")
        except OSError:
            pass
    probes = {}
    for at in PROBES:
        if at > window:
            break
        time.sleep(max(0.0, start + at - time.monotonic()))
        probes[at] = probe(server.url)
    time.sleep(max(0.0, start + window - time.monotonic()))
    closed = 0  # answered (a 408) or closed by the server
    for sock in sockets:
        try:
            sock.recv(1, socket.MSG_PEEK)
            closed += 1
        except BlockingIOError:
            pass  # still open, nothing said
        except OSError:
            closed += 1
        sock.close()
    lines1, bytes1 = server.log_size()
    return {
        "sockets": count,
        "probes": probes,
        "answered_or_closed_by_server": closed,
        "log_lines": lines1 - lines0,
        "log_bytes": bytes1 - bytes0,
        "accept_error_lines": server.log.read_bytes()[bytes0:].count(b"out of system resource"),
    }


def kernel_queued_kb(port: int) -> tuple[int, int]:
    """What the kernel holds for the connections to `port`: the server's unsent bytes (Send-Q of
    its sockets) and the client's unread ones (Recv-Q of the clients'), in KiB."""

    def queued(selector: str, column: int) -> int:
        out = subprocess.run(["ss", "-tnH", selector], capture_output=True, text=True).stdout
        return sum(int(line.split()[column]) for line in out.splitlines()) // 1024

    return queued(f"( sport = :{port} )", 2), queued(f"( dport = :{port} )", 1)


def no_reader(server: Server, window: float) -> dict:
    body = {
        "model": "target",
        "prompt": "ROMEO:",
        "max_tokens": 400,
        "ignore_eos": True,
        "n": 16,
        "logprobs": 5,
        "echo": True,
        "stream": True,
    }
    data = json.dumps(body).encode()
    port = int(server.url.rsplit(":", 1)[1])
    rss0 = server.rss_mb()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(data)}\r\n\r\n".encode()
        + data
    )
    samples, start = [], time.monotonic()
    while (elapsed := time.monotonic() - start) < window:
        stats = server.stats()
        server_send_q, client_recv_q = kernel_queued_kb(port)
        samples.append(
            {
                "t": round(elapsed, 1),
                "server_send_q_kb": server_send_q,
                "client_recv_q_kb": client_recv_q,
                "rss_mb": round(server.rss_mb()),
                "running": stats["active_requests"],
                "blocks_used": stats["blocks_used"],
                "tokens": stats["tokens_generated"],
            }
        )
        time.sleep(2)
    sock.close()
    return {"rss_before_mb": round(rss0), "samples": samples}


def mid_body(server: Server) -> dict:
    lines0, bytes0 = server.log_size()
    sock = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b'content-length: 100\r\n\r\n{"model": '
    )
    time.sleep(0.5)
    sock.close()
    time.sleep(1.0)
    lines1, bytes1 = server.log_size()
    return {"log_lines": lines1 - lines0, "log_bytes": bytes1 - bytes0}


def long_url(server: Server) -> dict:
    bytes0 = server.log_size()[1]
    status = probe_path(server, "/v1/" + "x" * 100_000)
    time.sleep(0.5)
    new = server.log.read_bytes()[bytes0:]
    return {"status": status, "longest_log_line": max(map(len, new.splitlines()), default=0)}


def probe_path(server: Server, path: str) -> int | str:
    sock = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    sock.settimeout(10)
    sock.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
    try:
        head = sock.recv(64)
    except TimeoutError:
        return "hang"
    finally:
        sock.close()
    return int(head.split()[1]) if head.startswith(b"HTTP/1.1") else head.decode(errors="replace")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--src", default=str(ROOT / "src"))
    parser.add_argument("--label", default="branch")
    parser.add_argument("--port", type=int, default=18431)
    parser.add_argument("--fd-limit", type=int, default=1024)
    parser.add_argument("--idle", type=int, default=2000)
    parser.add_argument("--window", type=float, default=40)
    parser.add_argument("--serve-args", default="", help="extra `serve` options, one string")
    parser.add_argument("--only", nargs="*", default=None, help="scenarios to run (default: all)")
    args = parser.parse_args()
    resource.setrlimit(resource.RLIMIT_NOFILE, resource.getrlimit(resource.RLIMIT_NOFILE)[::-1])
    log = Path(f"/tmp/connections_{args.label}.log")
    results = {"src": args.src, "load_before": load_str(), "serve_args": args.serve_args}
    for name, run in (
        ("idle", lambda s: idle_sockets(s, args.idle, args.window)),
        ("no_reader", lambda s: no_reader(s, args.window)),
        ("mid_body", mid_body),
        ("long_url", long_url),
    ):
        if args.only is not None and name not in args.only:
            continue
        server = Server(args.src, args.port, args.fd_limit, log, args.serve_args.split())
        try:
            results[name] = run(server)
        finally:
            server.stop()
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    results["load_after"] = load_str()
    results["machine"] = machine_record("connections benchmark")
    everything = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    everything.setdefault(args.label, {}).update(results)  # --only: the other scenarios stay
    RESULTS.write_text(json.dumps(everything, indent=1) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)} [{args.label}]")


if __name__ == "__main__":
    main()
