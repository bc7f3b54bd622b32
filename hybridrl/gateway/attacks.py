"""The gateway's attack set: what an agent (or anyone holding its key) can send, performed over real sockets
against a gateway in another process, each with a PASS/FAIL verdict. `hybridrl gateway check` runs it.

Every malformed body must be a 400 that names the problem (never a 500, never the episode's fault); a body
past `gateway.max_body_kb` a 413 without the server holding it (its RSS is sampled while it is sent); text
past `gateway.max_request_chars` a 400 before any tokenizing; special-token strings in any message role
encoded as text (they cannot forge turn structure); connections that send nothing, or their headers or body
a little at a time, closed after `gateway.read_timeout_s` while the gateway keeps serving.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

MiB = 1 << 20
RSS_LIMIT_MIB = 64              # what a refused request may add to the server's resident memory
VALID = {"model": "policy", "messages": [{"role": "user", "content": "What is 2 + 2?"}]}
MARKERS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|start_header_id|>")


@dataclass(kw_only=True)
class Target:
    """Where the gateway listens, the episode key the attacker holds, the server's pid (for its RSS)."""

    socket: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    key: str = ""
    pid: int | None = None
    read_timeout_s: float = 10.0

    def connect(self, timeout: float = 30.0) -> socket.socket:
        if self.socket:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            sock.connect(self.socket)
            return sock
        return socket.create_connection((self.host, self.port), timeout=timeout)


@dataclass
class Verdict:
    name: str
    what: str
    status: str                  # PASS | FAIL | SKIP
    detail: str = ""
    figures: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- HTTP by hand


def head(target: Target, path: str, length: int | None, *, key: bool = True, extra: str = "") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: hybridrl-gateway", "Content-Type: application/json", "Connection: close"]
    lines += [f"Authorization: Bearer {target.key}"] if key else []
    lines += [f"Content-Length: {length}"] if length is not None else ["Transfer-Encoding: chunked"]
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


def read_response(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of the response on `sock` (read to its end; 0 when the server sent none)."""
    data = b""
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except (ConnectionResetError, BrokenPipeError, socket.timeout):
        pass
    if not data.startswith(b"HTTP/"):
        return 0, {}
    top, _, payload = data.partition(b"\r\n\r\n")
    try:
        return int(top.split(b" ", 2)[1]), json.loads(payload or b"{}")
    except ValueError:
        return int(top.split(b" ", 2)[1]), {"raw": payload[:200].decode("utf-8", "replace")}


def post(target: Target, body: bytes, path: str = "/v1/chat/completions", *, key: bool = True) -> tuple[int, dict]:
    with target.connect() as sock:
        sock.sendall(head(target, path, len(body), key=key) + body)
        return read_response(sock)


def post_json(target: Target, body: dict, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    return post(target, json.dumps(body).encode(), path)


def error_of(body: dict) -> str:
    err = body.get("error")
    return (err.get("message") or "")[:120] if isinstance(err, dict) else str(body)[:120]


# ---------------------------------------------------------------------------------------------- the server's memory


class RssSampler:
    """The peak growth of a process's resident memory while the `with` block runs (sampled every 5 ms)."""

    def __init__(self, pid: int | None):
        self.pid, self.base, self.peak = pid, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def rss(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.rss())

    def __enter__(self) -> "RssSampler":
        if self.pid is not None:
            self.base = self.peak = self.rss()
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.pid is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self.rss())

    @property
    def grew_mib(self) -> float | None:
        return None if self.pid is None else round((self.peak - self.base) / MiB, 1)


def memory_verdict(name: str, what: str, status: int, want: int, rss: RssSampler, extra: str = "") -> Verdict:
    grew = rss.grew_mib
    ok = status == want and (grew is None or grew < RSS_LIMIT_MIB)
    note = "server RSS not measured (no pid)" if grew is None else f"server RSS +{grew} MiB (limit {RSS_LIMIT_MIB})"
    return Verdict(name, what, "PASS" if ok else "FAIL", f"HTTP {status} (want {want}), {note}{extra}",
                   {"http_status": status, "rss_grew_mib": grew})


# ---------------------------------------------------------------------------------------------- malformed bodies


def _chat(**fields: Any) -> bytes:
    return json.dumps({**VALID, **fields}).encode()


def _user(content: str) -> bytes:
    return json.dumps({"model": "p", "messages": [{"role": "user", "content": content}]}).encode()


MALFORMED: dict[str, tuple[str, bytes]] = {
    "not_json": ("/v1/chat/completions", b"{not json"),
    "empty_body": ("/v1/chat/completions", b""),
    "not_an_object": ("/v1/chat/completions", b"[1, 2, 3]"),
    "invalid_utf8": ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
    "nested_100k": ("/v1/chat/completions", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    "lone_surrogate": ("/v1/chat/completions", _user("a").replace(b'"a"', b'"a\\ud800b"')),
    "temperature_string": ("/v1/chat/completions", _chat(temperature="hot")),
    "n_string": ("/v1/chat/completions", _chat(n="2")),
    "max_tokens_negative": ("/v1/chat/completions", _chat(max_tokens=-1)),
    "stream_flag_string": ("/v1/chat/completions", _chat(stream="yes")),
    "stream_options_string": ("/v1/chat/completions", _chat(stream_options="yes")),
    "response_format_string": ("/v1/chat/completions", _chat(response_format="json")),
    "tools_function_string": ("/v1/chat/completions", _chat(tools=[{"type": "function", "function": "calc"}])),
    "tool_choice_function_string": ("/v1/chat/completions",
                                    _chat(tool_choice={"type": "function", "function": "calc"})),
    "stop_numbers": ("/v1/chat/completions", _chat(stop=[1, 2])),
    "messages_missing": ("/v1/chat/completions", b'{"model": "p"}'),
    "messages_not_a_list": ("/v1/chat/completions", _chat(messages="hi")),
    "unknown_role": ("/v1/chat/completions", _chat(messages=[{"role": "root", "content": "hi"}])),
    "content_number": ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": 7}])),
    "tool_calls_malformed": ("/v1/chat/completions", _chat(messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [{"function": "x"}]}])),
    "prompt_object": ("/v1/completions", b'{"model": "p", "prompt": {"a": 1}}'),
}


def malformed(target: Target, case: str) -> Verdict:
    path, body = MALFORMED[case]
    status, reply = post(target, body, path)
    return Verdict(f"malformed:{case}", f"a malformed request ({case}) is a 400 naming the problem",
                   "PASS" if status == 400 else "FAIL", f"HTTP {status}: {error_of(reply)}", {"http_status": status})


# ---------------------------------------------------------------------------------------------- sizes


def _push(sock: socket.socket, pieces: Any) -> tuple[int, int]:
    """Send every piece (as a careless client does, whatever the server answered) until the server closes;
    the response is read meanwhile. (status, bytes sent)."""
    got: list[bytes] = []
    reader = threading.Thread(target=_read_all, args=(sock, got), daemon=True)
    reader.start()
    sent = 0
    try:
        for piece in pieces:
            sock.sendall(piece)
            sent += len(piece)
        sock.shutdown(socket.SHUT_WR)
    except OSError:                       # the server closed the connection: it read no further
        pass
    reader.join(60)
    data = b"".join(got)
    return (int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0), sent


def _read_all(sock: socket.socket, got: list[bytes]) -> None:
    try:
        while chunk := sock.recv(1 << 16):
            got.append(chunk)
    except OSError:
        pass


def _body_pieces(total: int, chunked: bool) -> Any:
    piece = b" " * MiB
    for _ in range(total // MiB):
        yield (b"%x\r\n" % len(piece) + piece + b"\r\n") if chunked else piece
    if chunked:
        yield b"0\r\n\r\n"


def huge_body(target: Target, chunked: bool) -> Verdict:
    total = 100 * MiB
    with RssSampler(target.pid) as rss, target.connect(timeout=60) as sock:
        opener = b'{"messages": "'
        sock.sendall(head(target, "/v1/chat/completions", None if chunked else total)
                     + (b"%x\r\n%s\r\n" % (len(opener), opener) if chunked else opener))
        started = time.monotonic()
        status, sent = _push(sock, _body_pieces(total, chunked))
    how = "chunked" if chunked else "declared"
    return memory_verdict(f"body_100mb_{how}", f"a 100 MiB body ({how} length) is a 413, not held in memory",
                          status, 413, rss, f", {sent / MiB:.0f} MiB sent in {time.monotonic() - started:.2f} s")


def long_text(target: Target) -> Verdict:
    text = "lorem ipsum " * int(1.3 * MiB / 12)                   # 1.3 MiB of user text
    started = time.monotonic()
    with RssSampler(target.pid) as rss:
        status, reply = post(target, _user(text))
    return memory_verdict("text_1_3mib", "1.3 MiB of user text is refused before the tokenizer runs", status, 400,
                          rss, f", {time.monotonic() - started:.2f} s: {error_of(reply)[:60]}")


# ---------------------------------------------------------------------------------------------- special tokens


def special_tokens(target: Target, role: str) -> Verdict:
    """Eight copies of each marker in a `role` message: as text each is several tokens; as a special id, one."""
    what = f"special-token strings in a '{role}' message are text, not turn structure"
    base_status, base = post_json(target, _role(role, "x"))
    if base_status == 400 and role == "ipython":
        return Verdict(f"special_tokens:{role}", what, "PASS", f"the template has no {role} role: refused (400)")
    worst = None
    for marker in MARKERS:
        status, reply = post_json(target, _role(role, "x" + marker * 8))
        if status != 200 or base_status != 200:
            return Verdict(f"special_tokens:{role}", what, "FAIL", f"HTTP {status}/{base_status}: {error_of(reply)}")
        added = reply["usage"]["prompt_tokens"] - base["usage"]["prompt_tokens"]
        worst = added if worst is None else min(worst, added)
    ok = worst >= 16
    return Verdict(f"special_tokens:{role}", what, "PASS" if ok else "FAIL",
                   f"8 copies of a marker add >= {worst} prompt tokens (a special id would add 8)",
                   {"fewest_added": worst})


def _role(role: str, content: str) -> dict[str, Any]:
    first = [{"role": "user", "content": "hi"}] if role in ("tool", "ipython") else []
    return {"model": "p", "messages": first + [{"role": role, "content": content}]}


# ---------------------------------------------------------------------------------------------- slow clients


def slow_client(target: Target, opener: bytes, drip: bytes, interval: float, limit_s: float) -> float | None:
    """Seconds until the server closed a connection that sent `opener` then `drip` every `interval` (None:
    still open after `limit_s`)."""
    started = time.monotonic()
    with target.connect() as sock:
        try:
            if opener:
                sock.sendall(opener)
            sock.settimeout(interval)
            while time.monotonic() - started < limit_s:
                try:
                    if sock.recv(1 << 16) == b"":
                        return time.monotonic() - started
                except socket.timeout:
                    if drip:
                        sock.sendall(drip)
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - started
    return None


SLOW: dict[str, tuple[str, int, Callable[[Target], tuple[bytes, bytes]]]] = {
    "idle_connections": ("connections that send nothing are closed", 16, lambda t: (b"", b"")),
    "slow_headers": ("headers sent a line at a time (slowloris) are cut off", 16,
                     lambda t: (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n", b"X-Slow: 1\r\n")),
    "slow_body": ("a body sent a few bytes at a time is cut off (the episode is not at fault)", 4,
                  lambda t: (head(t, "/v1/chat/completions", 100_000) + b'{"messages": ', b"          ")),
}


def slow_attacks(target: Target, chosen: list[str]) -> list[Verdict]:
    """The chosen slow clients all at once; while they are held, a valid request must still be served."""
    limit = 2 * target.read_timeout_s + 2.0
    kinds = {name: spec for name, spec in SLOW.items() if name in chosen}
    with ThreadPoolExecutor(max_workers=max(1, sum(n for _, n, _ in kinds.values()))) as pool:
        futures = {name: [pool.submit(slow_client, target, *make(target), 0.25, limit) for _ in range(n)]
                   for name, (_, n, make) in kinds.items()}
        time.sleep(min(0.5, target.read_timeout_s / 2))
        served = serves(target) if "serves_during_slow_clients" in chosen else None
        out = []
        for name, (what, n, _) in kinds.items():
            closed = [f.result() for f in futures[name]]
            held = [c for c in closed if c is None]
            ok = not held
            detail = f"{n - len(held)}/{n} closed by the server, after {max(c or limit for c in closed):.1f} s " \
                     f"(gateway.read_timeout_s={target.read_timeout_s})"
            out.append(Verdict(name, what, "PASS" if ok else "FAIL", detail))
    return out + ([served] if served is not None else [])


def serves(target: Target) -> Verdict:
    started = time.monotonic()
    status, _ = post_json(target, VALID)
    return Verdict("serves_during_slow_clients", "a valid request is served while slow clients are held",
                   "PASS" if status == 200 else "FAIL", f"HTTP {status} in {time.monotonic() - started:.2f} s")


def abandoned_upload(target: Target) -> Verdict:
    """A client that closes its upload half way: no 500, the episode still serves its key."""
    with target.connect() as sock:
        sock.sendall(head(target, "/v1/chat/completions", 1000) + b'{"messages": [')
    time.sleep(0.2)
    status, reply = post_json(target, VALID)
    return Verdict("abandoned_upload", "a client that closes its upload half way leaves its episode serving",
                   "PASS" if status == 200 else "FAIL",
                   f"the next request: HTTP {status}" + ("" if status == 200 else f" {error_of(reply)}"))


def no_key(target: Target) -> Verdict:
    status, _ = post(target, json.dumps(VALID).encode(), key=False)
    return Verdict("no_key", "a request without an episode key is refused (401)", "PASS" if status == 401 else "FAIL",
                   f"HTTP {status}")


# ---------------------------------------------------------------------------------------------- the set

NAMES = ["no_key", *(f"malformed:{c}" for c in MALFORMED), "body_100mb_declared", "body_100mb_chunked",
         "text_1_3mib", *(f"special_tokens:{r}" for r in ("system", "user", "tool", "ipython")), "abandoned_upload",
         *SLOW, "serves_during_slow_clients"]


def run_attacks(target: Target, names: list[str] | None = None) -> list[Verdict]:
    """Every attack (or those named), in order; the slow clients run together."""
    chosen = [n for n in NAMES if names is None or n in names or n.split(":")[0] in names]
    out: list[Verdict] = []
    for name in chosen:
        kind, _, arg = name.partition(":")
        if kind == "malformed":
            out.append(malformed(target, arg))
        elif kind == "special_tokens":
            out.append(special_tokens(target, arg))
        elif name in ("body_100mb_declared", "body_100mb_chunked"):
            out.append(huge_body(target, chunked=name.endswith("chunked")))
        elif name in ("text_1_3mib", "abandoned_upload", "no_key"):
            out.append({"text_1_3mib": long_text, "abandoned_upload": abandoned_upload, "no_key": no_key}[name](target))
    if any(n in SLOW or n == "serves_during_slow_clients" for n in chosen):
        out += slow_attacks(target, chosen)
    return out


def episode_verdict(report: dict[str, Any]) -> Verdict:
    """After the set, from the fresh gateway's own report: the held episode is not INFRA_INVALID, no 500."""
    statuses, errors = report.get("statuses", []), report.get("service", {}).get("errors", -1)
    ok = statuses and "infra_invalid" not in statuses and errors == 0
    return Verdict("episode_not_invalid", "after every attack the episode is not INFRA_INVALID and no request was a 500",
                   "PASS" if ok else "FAIL", f"episode {statuses} {report.get('end_reasons')}, {errors} server errors, "
                                             f"{report.get('timed_out')} connections closed by the read deadline",
                   {"report": report})
