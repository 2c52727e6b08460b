"""Tool calls on the chat route: tools into the prompt, the model's `<tool_call>` output into OpenAI
`tool_calls`.

The format is the Hermes/Qwen one, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, which
templates with tool support (Qwen2.5, Hermes, SmolLM3 ...) ask for. A template that does not read `tools`
(SmolLM2's) gets a system message that lists the tools and this format, as llama-server's generic handler
does. With tool_choice "required" or a named function the output is constrained to one such call
(powerinfer.server.grammar).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from powerinfer.server.errors import ApiError

OPEN = "<tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ContentStream:
    """The streamed content of an answer that may hold tool calls: text before the first `<tool_call>` goes
    out as it comes, from the tag on it is kept for the parser (a partial tag at the end waits)."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0

    def feed(self, piece: str) -> str:
        self.text += piece
        cut = self.text.find(OPEN)
        if cut < 0:
            cut = len(self.text)
            for n in range(min(len(OPEN) - 1, len(self.text)), 0, -1):
                if self.text.endswith(OPEN[:n]):
                    cut -= n
                    break
        out = self.text[self.sent : cut] if cut > self.sent else ""
        self.sent = max(self.sent, cut)
        return out

    def rest(self) -> str:
        """What was held back (the answer had no call after all)."""
        out = self.text[self.sent :]
        self.sent = len(self.text)
        return out


def tool_choice(choice: str | dict[str, Any] | None, tools: list[dict[str, Any]]) -> tuple[str, list[Any]]:
    """("none" | "auto" | "required", the tools the model may call) for OpenAI's tool_choice."""
    if not tools or choice == "none":
        return "none", []
    if choice is None or choice == "auto":
        return "auto", tools
    if choice == "required":
        return "required", tools
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        chosen = [t for t in tools if t["function"]["name"] == name]
        if chosen:
            return "required", chosen
        raise ApiError(400, f"tool_choice names no tool of this request: {name!r}", param="tool_choice")
    raise ApiError(400, "tool_choice must be none, auto, required or a function", param="tool_choice")


def system_prompt(tools: list[dict[str, Any]]) -> str:
    """The tool instructions for a template that does not render `tools` itself."""
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return (
        "You can call functions. The available functions, as JSON schemas:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call a function, answer only with\n"
        '<tool_call>{"name": <function name>, "arguments": <arguments as a JSON object>}</tool_call>'
    )


def call_text(call: dict[str, Any]) -> str:
    """An earlier assistant tool call written back in the model's format."""
    fn = call.get("function") or {}
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        pass
    return (
        "<tool_call>"
        + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
        + "</tool_call>"
    )


def parse(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(the text outside the calls or None, OpenAI tool_calls) of a model answer; blocks that are not a
    JSON call stay text."""
    calls, rest, at = [], [], 0
    for m in _CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        items = obj if isinstance(obj, list) else [obj]
        if not all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in items):
            continue
        rest.append(text[at : m.start()])
        at = m.end()
        for o in items:
            args = o.get("arguments", o.get("parameters", {}))
            calls.append(
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {
                        "name": o["name"],
                        "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                    },
                }
            )
    if not calls:
        return text, []
    rest.append(text[at:])
    content = "".join(rest).strip()
    return content or None, calls


def call_schema(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One JSON schema per tool for the object inside `<tool_call>`."""
    return [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "arguments": t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
        }
        for t in tools
    ]
