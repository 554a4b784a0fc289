# SPDX-License-Identifier: Apache-2.0
"""Benchmarks of vllm-infinigen (run the scripts directly)."""
