# SPDX-License-Identifier: Apache-2.0
"""GPU benchmarks that need torch (and transformers to record traces) but not vLLM."""
