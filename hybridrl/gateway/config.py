"""The `gateway` section: the OpenAI-compatible inference gateway that agents written with the OpenAI
client talk to (`task.agent`). Import-light (no torch, no web stack)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from hybridrl.config.fields import ConfigValueError, check_choice, check_positive, check_range, knob

TOOL_PARSERS = ("auto", "hermes", "llama3", "actions", "none")
REASONING_PARSERS = ("auto", "think", "none")


@dataclass(kw_only=True)
class GatewayConfig:
    """Where the gateway listens, how it reads the model's turns and what it does when a chat template
    is not append-only. Episode budgets are the agent section's (`agent.max_turns` ...)."""

    listen: str = knob("unix", "unix (a socket in a private 0700 directory of this rank) | tcp (loopback only, "
                               "gateway.host:gateway.port)")
    host: str = knob("127.0.0.1", "listen=tcp: a loopback address (127.0.0.0/8, ::1 or localhost); anything else "
                                  "is refused")
    port: int = knob(0, "listen=tcp: the port (0: one the OS picks)")
    tool_parser: str = knob("auto", "how tool calls are read from a turn into OpenAI tool_calls: hermes "
                                    "(<tool_call>{json}</tool_call>: Qwen2.5, Qwen3, Hermes) | llama3 (a JSON "
                                    "object {name, parameters}, after <|python_tag|> or alone) | actions (the "
                                    "task's action formats: <calc>, <tool_call>) | none | auto (from the chat "
                                    "template: hermes if it mentions <tool_call>, llama3 if it mentions "
                                    "<|python_tag|> or ipython, else actions)")
    reasoning_parser: str = knob("auto", "think (<think>...</think> is returned as reasoning_content) | none | "
                                         "auto (think when the chat template mentions <think>)")
    render_tools: bool = knob(True, "render a request's `tools` with the chat template (false: parse calls to "
                                    "them but keep the list out of the prompt, for a model trained without it)")
    on_drift: str = knob("mark", "a rendering that does not extend the episode's tokens (a chat template that is "
                                 "not append-only): mark (keep the exact tokens, append the new messages as the "
                                 "template's delta, mark the trajectory) | split (serve the fresh rendering as a "
                                 "new segment; the episode trains on its last segment). Counted either way")
    check_tokens: bool = knob(True, "compare each request's captured ids with one tokenization of its full "
                                    "rendering and count the differences (token_drift); the captured ids are "
                                    "what the model sees either way")
    prefix_affinity_slack: int = knob(8, "routing: a new episode goes to a replica that already serves its group "
                                         "(the prompt prefix is warm there) while that replica has at most this many "
                                         "more episodes than the least-loaded one")
    agent_grace_s: float = knob(5.0, "after agent.max_episode_s the agent has this long to return (its requests "
                                     "get budget errors) before it is cancelled")
    model_name: str = knob("policy", "the model name /v1/models reports (requests may name any model)")
    http_thread: bool = knob(False, "serve HTTP from a loop in a thread of its own, handing each request's generation "
                                    "to the engine's loop (true), or on the engine's loop itself (false: measured "
                                    "faster on CPU, where the two threads take turns on the interpreter lock; "
                                    "docs/gateway.md)")
    max_body_kb: int = knob(4096, "largest request body, KiB: a larger one is refused (413) without being read "
                                  "past the limit")
    max_request_chars: int = knob(1 << 20, "characters of text in one request's messages (or prompt): more is "
                                           "refused (400, budget_exceeded) before the chat template and tokenizer run")
    max_connections: int = knob(1024, "connections and requests the HTTP server holds at once; past it, new "
                                      "requests get 503 (uvicorn's limit_concurrency)")
    keep_alive_s: float = knob(30.0, "an idle keep-alive connection is closed after this long")
    read_timeout_s: float = knob(10.0, "a request's headers and body must arrive within this long of its first "
                                       "byte (or of the connection): a slower one is closed (slow-header / "
                                       "slow-body clients cannot hold connections)")
    special_tokens_in_messages: str = knob(
        "text", "special-token strings (e.g. <|im_start|>) inside the agent's messages of every role but the "
                "assistant turns the gateway returned: text (made plain text: they cannot forge turn structure) | "
                "special (encoded as the special tokens, for an agent that builds turn markup itself; tool and ipython outputs are made text either way)")

    def __post_init__(self) -> None:
        check_choice("listen", self.listen, ("unix", "tcp"))
        check_choice("special_tokens_in_messages", self.special_tokens_in_messages, ("text", "special"))
        for name in ("max_body_kb", "max_request_chars", "max_connections"):
            check_positive(name, getattr(self, name))
        check_positive("keep_alive_s", self.keep_alive_s)
        check_positive("read_timeout_s", self.read_timeout_s)
        check_choice("tool_parser", self.tool_parser, TOOL_PARSERS)
        check_choice("reasoning_parser", self.reasoning_parser, REASONING_PARSERS)
        check_choice("on_drift", self.on_drift, ("mark", "split"))
        check_range("port", self.port, 0, 65535)
        check_positive("prefix_affinity_slack", self.prefix_affinity_slack, allow_zero=True)
        check_positive("agent_grace_s", self.agent_grace_s, allow_zero=True)
        if not is_loopback(self.host):
            raise ConfigValueError("host", f"the gateway listens on loopback only (127.0.0.1, ::1, localhost), "
                                           f"got {self.host!r}")
        if not self.model_name:
            raise ConfigValueError("model_name", "must not be empty")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False

