"""Data for the CPU default job: char tokenizer, synthetic addition task, JSONL prompts,
tiny model configs. (JSON files under ``data/configs`` ship as package data.)"""

from .dataset import PromptRecord, load_prompt_jsonl
from .synthetic import addition_problems, count_addition_problems, write_jsonl
from .tiny_model import padded_vocab_size, tiny_dense_config, tiny_moe_config
from .tokenizer import DEFAULT_CHARS, SPECIAL_TOKENS, CharTokenizer

__all__ = [
    "DEFAULT_CHARS",
    "SPECIAL_TOKENS",
    "CharTokenizer",
    "PromptRecord",
    "addition_problems",
    "count_addition_problems",
    "load_prompt_jsonl",
    "padded_vocab_size",
    "tiny_dense_config",
    "tiny_moe_config",
    "write_jsonl",
]
