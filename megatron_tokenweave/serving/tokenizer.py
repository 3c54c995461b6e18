"""An offline tokenizer for models with random or self-made weights: UTF-8 bytes are tokens.

Megatron's byte-level tokenizer cannot detokenize ids above 255, which a model with a real
vocabulary (128K for Llama) will generate; this one renders such ids as "<id>" so any vocabulary
works. It offers what Megatron's engines, controllers and servers call.
"""

from __future__ import annotations

from collections.abc import Sequence

BYTES = 256


class ByteTokenizer:
    """Token ids 0..255 are the UTF-8 bytes of the text; id `eod` (default 0, the NUL byte) ends
    a generation. Larger ids (a model vocabulary above 256) detokenize as "<id>"."""

    def __init__(self, vocab_size: int = BYTES, eod: int = 0) -> None:
        if vocab_size < BYTES:
            raise ValueError(f"vocab_size must be at least {BYTES}, got {vocab_size}")
        if not 0 <= eod < vocab_size:
            raise ValueError(f"eod id {eod} is outside the vocabulary of {vocab_size}")
        self.vocab_size = vocab_size
        self.eod = self.eos_id = eod
        self.bos = None
        self.pad = eod

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        out: list[str] = []
        run = bytearray()
        for i in (int(t) for t in ids):
            if skip_special_tokens and i == self.eod:
                continue
            if i < BYTES:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            out.append(f"<{i}>")
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def offsets(self, ids: Sequence[int], text: str) -> list[int]:
        """Character offset in `text` where each token starts (Megatron's segment API)."""
        starts, pos = [], 0
        for i in ids:
            starts.append(pos)
            pos += len(self.detokenize([i]))
        return starts
