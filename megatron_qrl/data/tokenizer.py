"""A character-level tokenizer shipped with the package (built deterministically, no files).

Ids: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3, then one id per character of
:data:`DEFAULT_CHARS` (printable ASCII 32..126 and ``\\n``) in that order: 100 tokens. The
same vocabulary is produced on every machine, so checkpoints and tokenizers always agree.

``save(dir)`` writes ``qrl_char_tokenizer.json`` (our format) and, because it is cheap, an
HF ``tokenizer.json`` + ``tokenizer_config.json`` (WordLevel model, one-character
pre-tokenizer, ``Fuse`` decoder) so ``transformers.AutoTokenizer.from_pretrained(dir)`` loads
the same ids. The HF copy treats the literal text ``<eos>`` etc. as the special token;
:meth:`CharTokenizer.encode` never does (it encodes those five characters).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from ..utils.io import atomic_write_text

__all__ = ["DEFAULT_CHARS", "SPECIAL_TOKENS", "TOKENIZER_FILE", "CharTokenizer"]

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
DEFAULT_CHARS = "".join(chr(c) for c in range(32, 127)) + "\n"
TOKENIZER_FILE = "qrl_char_tokenizer.json"
_FORMAT = "megatron_qrl.char_tokenizer.v1"


class CharTokenizer:
    """One token per character; unknown characters map to ``<unk>`` (or raise if strict)."""

    def __init__(self, chars: str = DEFAULT_CHARS) -> None:
        if len(set(chars)) != len(chars) or not chars:
            raise ValueError("CharTokenizer: chars must be non-empty and without duplicates")
        self.chars = chars
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = range(len(SPECIAL_TOKENS))
        self._ids = {c: i + len(SPECIAL_TOKENS) for i, c in enumerate(chars)}

    @property
    def vocab_size(self) -> int:
        return len(SPECIAL_TOKENS) + len(self.chars)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False,
               strict: bool = False) -> list[int]:
        """Token ids of ``text``; ``strict`` raises on a character outside the vocabulary."""
        ids = [self.bos_id] if add_bos else []
        for pos, ch in enumerate(text):
            tid = self._ids.get(ch)
            if tid is None:
                if strict:
                    raise ValueError(f"CharTokenizer: character {ch!r} at position {pos} of "
                                     f"{text[:40]!r} is not in the vocabulary")
                tid = self.unk_id
            ids.append(tid)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of ``ids``; specials are dropped (or rendered as ``<pad>`` etc.)."""
        out = []
        n_special = len(SPECIAL_TOKENS)
        for tid in ids:
            tid = int(tid)
            if not 0 <= tid < self.vocab_size:
                raise ValueError(f"CharTokenizer: id {tid} outside [0, {self.vocab_size})")
            if tid < n_special:
                if not skip_special:
                    out.append(SPECIAL_TOKENS[tid])
            else:
                out.append(self.chars[tid - n_special])
        return "".join(out)

    # ---- files --------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": _FORMAT, "special_tokens": list(SPECIAL_TOKENS), "chars": self.chars}

    def save(self, directory: str | Path, hf: bool = True) -> Path:
        """Write ``TOKENIZER_FILE`` (and the HF files if ``hf``) into ``directory``."""
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(root / TOKENIZER_FILE, json.dumps(self.to_dict(), indent=1))
        if hf:
            self._save_hf(root)
        return root / TOKENIZER_FILE

    @classmethod
    def load(cls, path: str | Path) -> CharTokenizer:
        """Load from ``path`` (the JSON file or the directory holding it)."""
        p = Path(path)
        p = p / TOKENIZER_FILE if p.is_dir() else p
        if not p.is_file():
            raise FileNotFoundError(f"CharTokenizer: {p} not found (write it with .save(dir))")
        data = json.loads(p.read_text())
        if data.get("format") != _FORMAT or tuple(data.get("special_tokens", ())) != SPECIAL_TOKENS:
            raise ValueError(f"CharTokenizer: {p} is not a {_FORMAT} file")
        return cls(data["chars"])

    def _save_hf(self, root: Path) -> None:
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

        vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)} | dict(self._ids)
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens(list(SPECIAL_TOKENS))
        atomic_write_text(root / "tokenizer.json", tok.to_str())
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>",
               "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>",
               "model_max_length": 1 << 20}
        atomic_write_text(root / "tokenizer_config.json", json.dumps(cfg, indent=1))
