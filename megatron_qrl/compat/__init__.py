"""Version shims around upstream libraries; one module per shim (see each header).

``cpu``: run megatron-core on CPU/gloo. ``distributed``: gloo + ``parallel_state`` setup.
Nothing here is applied at import time; callers enable shims explicitly.
"""

from megatron_qrl.compat.cpu import (
    cpu_device_mode,
    cpu_megatron_enabled,
    disable_cpu_megatron,
    enable_cpu_megatron,
)
from megatron_qrl.compat.distributed import (
    CpuParallelLayout,
    destroy_cpu_distributed,
    init_cpu_distributed,
)

__all__ = [
    "CpuParallelLayout",
    "cpu_device_mode",
    "cpu_megatron_enabled",
    "destroy_cpu_distributed",
    "disable_cpu_megatron",
    "enable_cpu_megatron",
    "init_cpu_distributed",
]
