"""A tiny random-weight llama model for llama-server, written with llama.cpp's own `gguf` package.

    python -m tests.realengine.model OUT.gguf

No download and no trained weights: the model is 2 layers x 128 dimensions with a small
SentencePiece (SPM) vocabulary, seeded, so the same seed writes the same bytes. It talks
nonsense at a few thousand tokens per second on one core, which is what a test of the proxy
and the sidecar needs: a real llama-server with real slots, queues, prompt cache and metrics.

Answers are plain ASCII text and every request runs to its `max_tokens`: the end-of-sequence,
control and byte tokens (the bytes >= 0x80 would make invalid UTF-8 pieces) can never be
sampled. That is built into the weights, not asked of each request: dimension 0 of the
residual stream is a constant (every token embedding has 1.0 there and no layer writes to
it), so after the final norm it is a large positive number, and the output rows of the
blocked tokens weigh it by -50: their logits sit hundreds below every allowed token's.
"""

from __future__ import annotations

import string
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

SEED = 20261201
BLOCK_WEIGHT = -50.0
_WORDS = (
    "the", "of", "and", "to", "in", "is", "it", "that", "for", "on", "with", "as", "was", "at",
    "by", "be", "this", "are", "from", "or", "have", "an", "they", "which", "one", "you", "were",
    "all", "we", "can", "there", "been", "has", "when", "more", "will", "would", "no", "out", "so",
    "if", "what", "about", "up", "time", "model", "server", "proxy", "token", "cache", "queue",
    "slot", "load", "health", "route", "pool", "worker", "engine", "stream", "reply", "fast",
    "slow", "green", "blue", "red", "river", "stone", "cloud", "paper", "light", "sound", "north",
    "south", "east", "west",
)


@dataclass(frozen=True, slots=True)
class ModelShape:
    layers: int = 2
    dims: int = 128
    heads: int = 4
    ff: int = 256
    context: int = 16384  # trained context: a slot may hold up to this many tokens


@dataclass(frozen=True, slots=True)
class Vocab:
    tokens: list[str]
    scores: list[float]
    types: list[int]
    allowed: np.ndarray  # bool per token: may be generated

    @property
    def size(self) -> int:
        return len(self.tokens)


def vocabulary() -> Vocab:
    """<unk>, <s>, </s>, the 256 byte-fallback pieces, then ASCII characters and words."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    scores = [0.0, 0.0, 0.0]
    for byte in range(256):
        tokens.append(f"<0x{byte:02X}>")
        types.append(gguf.TokenType.BYTE)
        scores.append(0.0)
    pieces = ["\u2581"] + [c for c in string.ascii_letters + string.digits + ".,;:!?'-()"]
    pieces += [f"\u2581{word}" for word in _WORDS] + list(_WORDS)
    seen: set[str] = set()
    for rank, piece in enumerate(pieces):
        if piece in seen:
            continue
        seen.add(piece)
        tokens.append(piece)
        types.append(gguf.TokenType.NORMAL)
        # SPM merges by score: longer pieces first so words come out whole.
        scores.append(float(len(piece)) - rank * 1e-4)
    allowed = np.array([t == gguf.TokenType.NORMAL for t in types])
    return Vocab(tokens, scores, [int(t) for t in types], allowed)


CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def write_model(path: Path, *, shape: ModelShape = ModelShape(), seed: int = SEED) -> Path:
    """Write the model to `path` (atomically) and return it; the same seed gives the same bytes."""
    vocab = vocabulary()
    rng = np.random.default_rng(seed)
    d, ff = shape.dims, shape.ff

    def weight(rows: int, cols: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    ones = np.ones(d, dtype=np.float32)
    embed = weight(vocab.size, d)
    embed[:, 0] = 1.0  # the constant dimension
    output = weight(vocab.size, d, 0.1)
    output[:, 0] = np.where(vocab.allowed, 0.0, BLOCK_WEIGHT)
    tensors: list[tuple[str, np.ndarray]] = [("token_embd.weight", embed)]
    for layer in range(shape.layers):
        attn_out = weight(d, d)
        attn_out[0, :] = 0.0  # nothing writes to dimension 0
        down = weight(d, ff)
        down[0, :] = 0.0
        tensors += [
            (f"blk.{layer}.attn_norm.weight", ones.copy()),
            (f"blk.{layer}.attn_q.weight", weight(d, d)),
            (f"blk.{layer}.attn_k.weight", weight(d, d)),
            (f"blk.{layer}.attn_v.weight", weight(d, d)),
            (f"blk.{layer}.attn_output.weight", attn_out),
            (f"blk.{layer}.ffn_norm.weight", ones.copy()),
            (f"blk.{layer}.ffn_gate.weight", weight(ff, d)),
            (f"blk.{layer}.ffn_up.weight", weight(ff, d)),
            (f"blk.{layer}.ffn_down.weight", down),
        ]
    tensors += [("output_norm.weight", ones.copy()), ("output.weight", output)]

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), "llama")
    writer.add_name("confgen-test-tiny")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(vocab.size)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(d)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.heads)
    writer.add_rope_dimension_count(d // shape.heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(vocab.tokens)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, array in tensors:
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(path)
    return path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m tests.realengine.model OUT.gguf", file=sys.stderr)
        return 2
    print(write_model(Path(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
