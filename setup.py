"""megatron_qrl: low-precision rollouts for Megatron-core RL, fast and stable."""

from setuptools import find_packages, setup

setup(
    name="megatron_qrl",
    version="0.1.0",
    description=(
        "Quantized (INT8/FP8/W4A16/NVFP4) SGLang rollouts for Megatron-core RL, with the "
        "rollout-aligned training forward and off-policy corrections that keep them stable."
    ),
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_qrl", "megatron_qrl.*"]),
    package_data={"megatron_qrl": ["data/*", "data/**/*", "rollout_sglang/kernels/configs/*/*.json"]},
    install_requires=[
        # torch is never resolved from an open range on a fresh machine: install with
        # `-c constraints-cpu.txt` (CPU) or on top of the machine's CUDA torch (GPU).
        "torch>=2.4",
        "megatron-core>=0.16.1",
        "nvidia-modelopt>=0.47.0",
        # modelopt imports these without declaring them (measured with 0.47.0)
        "requests",
        "huggingface_hub",
        "transformers>=4.51",
        "safetensors",
        "numpy",
        "tqdm",
        "matplotlib",
        "sympy",  # megatron_qrl.rewards.math (symbolic answer comparison)
        # megatron-core dist_checkpointing's writer imports it lazily (measured with 0.16.1)
        "psutil",
    ],
    extras_require={
        # ray runs on CPU: the Ray-mode tests run in CI too
        "test": ["pytest>=8", "pytest-xdist>=3.6", "ruff>=0.6", "ray>=2.40", "tensorboard==2.21.0",
                 # SGLang's event loop: the crash tests run their fake engine on it too
                 "uvloop==0.21.0",
                 # slime 0.3.1's loss module imports it: tests/integrations/test_integrations_slime*.py
                 "httpx",
                 # slime 0.3.1's reward dispatch (slime.rollout.rm_hub) imports them:
                 # tests/integrations/test_integrations_slime_data.py
                 "aiohttp", "pylatexenc"],
        "ray": ["ray>=2.40"],
        # GPU-only: neither installs nor imports on a CPU machine; imported lazily.
        "gpu": ["transformer-engine[pytorch]>=2.8", "sglang>=0.5.17"],
    },
    entry_points={
        "console_scripts": [
            "qrl-quant-report=megatron_qrl.models.quant_report_cli:main",
            "qrl-train=megatron_qrl.rl.cli:main",
        ],
    },
)
