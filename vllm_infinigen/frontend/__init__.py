# SPDX-License-Identifier: Apache-2.0
"""Front end (the ``vllm serve`` / ``LLM`` process): the flags and keywords,
the start-up checks, the skew file, and the ``vllm-infinigen`` command line."""
