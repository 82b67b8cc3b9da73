"""What the picker reads of a request body: the prompt as chained block hashes, and its size.

Prompt text: chat `messages` in order, each message serialised canonically (role, then its
content, text parts joined), so a conversation that grows by turns has the previous turns'
text as its prefix, as the engine's chat template does; completions `prompt` (a string, or
the first of a list). The text is cut into `block_chars` chunks (64: vLLM's 16-token KV
block at ~4 characters a token, the inference extension's approximation) and chained:

    h_0 = H(model),  h_i = H(h_{i-1} || chunk_i)

so a hit on block i implies the whole prefix up to it matches. At most `max_blocks` blocks
(256: ~4k tokens) are hashed; the trailing partial block is hashed too. H is BLAKE2b-64
(standard library; no dependency for a hash).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any

__all__ = ["PromptInfo", "block_hashes", "parse_body"]

CHARS_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class PromptInfo:
    model: str | None
    text: str  # what is hashed (chat messages canonicalised, or the prompt)
    max_tokens: int | None
    # A conversation's identity that every turn shares: the hash of its text through the first
    # message after the system ones (None: no such message, e.g. a completions prompt).
    home: int | None = None
    # characters of `text` through the last assistant message: what a conversation's earlier
    # turns left in some engine's cache (0 for a first turn or a one-shot request)
    history_chars: int = 0
    home_chars: int = 0  # characters of `text` `home` covers

    @property
    def prompt_tokens(self) -> int:
        return max(1, len(self.text) // CHARS_PER_TOKEN)


def _content(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts: [{"type": "text", "text": ...}, {"type": "image_url", ...}]
        parts = []
        for part in value:
            if isinstance(part, Mapping):
                text = part.get("text")
                parts.append(text if isinstance(text, str) else json.dumps(part, sort_keys=True, default=str))
            else:
                parts.append(str(part))
        return "\x1f".join(parts)
    return "" if value is None else json.dumps(value, sort_keys=True, default=str)


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def parse_body(raw: bytes) -> PromptInfo | None:
    """The prompt of an OpenAI chat/completions body; None when it is not one (not JSON, no prompt)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: hostile nesting
        return None
    if not isinstance(body, dict):
        return None
    model = body.get("model") if isinstance(body.get("model"), str) else None
    messages = body.get("messages")
    if isinstance(messages, list):
        chunks = []
        home_chars = history = size = 0
        for message in messages:
            if isinstance(message, Mapping):
                role = message.get("role", "")
                chunk = f"<{role}>{_content(message.get('content'))}\x1e"
                chunks.append(chunk)
                size += len(chunk)
                if not home_chars and role not in ("system", "developer"):
                    home_chars = size
                if role == "assistant":
                    history = size
        text = "".join(chunks)
        home = _home(model, text[:home_chars]) if home_chars else None
        return PromptInfo(model, text, _max_tokens(body), home, history, home_chars)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return PromptInfo(model, prompt, _max_tokens(body))
    if isinstance(prompt, list):  # token ids
        return PromptInfo(model, ",".join(str(t) for t in prompt), _max_tokens(body))
    return None


def _home(model: str | None, head: str) -> int:
    digest = blake2b(head.encode("utf-8", "surrogatepass"), digest_size=8, key=(model or "").encode()[:64])
    return int.from_bytes(digest.digest(), "little")


def block_hashes(text: str, model: str | None, *, block_chars: int = 64, max_blocks: int = 256) -> list[int]:
    """Chained hashes of the prompt's blocks (see the module docstring)."""
    prev = blake2b((model or "").encode(), digest_size=8).digest()
    out: list[int] = []
    data = text.encode("utf-8", "surrogatepass")
    step = block_chars  # bytes: equal to characters for ASCII, and stable for any text
    for start in range(0, min(len(data), step * max_blocks), step):
        prev = blake2b(prev + data[start:start + step], digest_size=8).digest()
        out.append(int.from_bytes(prev, "little"))
    return out
