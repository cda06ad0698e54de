"""The registered formats. Importing this package registers them all (once)."""

from . import bf16, channel, fp8_block, w4a16, nvfp4  # noqa: F401,I001  (registration order)
